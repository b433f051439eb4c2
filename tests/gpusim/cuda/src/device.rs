//! Initialisation, versions and devices: what the config describes, in the driver's terms.

use std::ffi::{c_char, c_uint};

use gpusim_core::config::normalize_bus_id;
use gpusim_core::{GpuConfig, PcieLevel};

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;

/// Whether devices `a` and `b` can access each other's memory (NVLink, or PCIe under a
/// common host bridge).
pub fn peer_capable(d: &Driver, a: usize, b: usize) -> bool {
    let (pcie, nvlinks) = d.st.config.link_between(a, b);
    nvlinks > 0
        || matches!(
            pcie,
            PcieLevel::Switch | PcieLevel::MultiSwitch | PcieLevel::HostBridge
        )
}

/// `cuDeviceGetAttribute` for a GPU like the configured one (A100-class defaults for what
/// the config does not describe).
pub fn attribute(g: &GpuConfig, numa: i32, attr: u32) -> Option<i32> {
    let (major, minor) = g.cc();
    let (dom, bus, dev, _) = g.pci_parts();
    Some(match attr {
        1 => 1024,                                // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,                            // MAX_BLOCK_DIM_X/Y
        4 => 64,                                  // MAX_BLOCK_DIM_Z
        5 => i32::MAX,                            // MAX_GRID_DIM_X
        6 | 7 => 65535,                           // MAX_GRID_DIM_Y/Z
        8 => 49152,                               // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 65536,                               // TOTAL_CONSTANT_MEMORY
        10 => 32,                                 // WARP_SIZE
        11 => i32::MAX,                           // MAX_PITCH
        12 => 65536,                              // MAX_REGISTERS_PER_BLOCK
        13 => (g.max_sm_clock_mhz * 1000) as i32, // CLOCK_RATE (kHz)
        14 => 512,                                // TEXTURE_ALIGNMENT
        15 => 1,                                  // GPU_OVERLAP
        16 => g.sm_count as i32,                  // MULTIPROCESSOR_COUNT
        17 => 0,                                  // KERNEL_EXEC_TIMEOUT
        18 => 0,                                  // INTEGRATED
        19 => 1,                                  // CAN_MAP_HOST_MEMORY
        20 => 0,                                  // COMPUTE_MODE (default)
        21 => 131072,
        22 => 131072,
        23 => 65536,
        24..=26 => 16384,
        27 | 28 => 32768,
        29 => 2048,
        30 => 512,                                 // SURFACE_ALIGNMENT
        31 => 1,                                   // CONCURRENT_KERNELS
        32 => 1,                                   // ECC_ENABLED
        33 => bus as i32,                          // PCI_BUS_ID
        34 => dev as i32,                          // PCI_DEVICE_ID
        35 => 0,                                   // TCC_DRIVER
        36 => (g.max_mem_clock_mhz * 1000) as i32, // MEMORY_CLOCK_RATE (kHz)
        37 => 5120,                                // GLOBAL_MEMORY_BUS_WIDTH
        38 => 40 << 20,                            // L2_CACHE_SIZE
        39 => g.max_threads_per_sm as i32,         // MAX_THREADS_PER_MULTIPROCESSOR
        40 => 3,                                   // ASYNC_ENGINE_COUNT
        41 => 1,                                   // UNIFIED_ADDRESSING
        42 => 32768,
        43 => 2048,
        44 => 1,
        45 | 46 => 32768,
        47..=49 => 8192,
        50 => dom as i32, // PCI_DOMAIN_ID
        51 => 32,         // TEXTURE_PITCH_ALIGNMENT
        52 | 53 => 32768,
        54 => 2046,
        55..=68 => 32768,
        69 => 268_435_456,
        70 | 71 => 131_072,
        72 => 2_097_120,
        73 | 74 => 32768,
        75 => major, // COMPUTE_CAPABILITY_MAJOR
        76 => minor, // COMPUTE_CAPABILITY_MINOR
        77 => 32768,
        78 => 1, // STREAM_PRIORITIES_SUPPORTED
        79 | 80 => 1,
        81 => 167_936, // MAX_SHARED_MEMORY_PER_MULTIPROCESSOR
        82 => 65536,   // MAX_REGISTERS_PER_MULTIPROCESSOR
        83 => 1,       // MANAGED_MEMORY
        84 => 0,       // MULTI_GPU_BOARD
        85 => 0,
        86 => 0,
        87 => 2,
        88 => 0, // PAGEABLE_MEMORY_ACCESS
        89 => 1, // CONCURRENT_MANAGED_ACCESS
        90 => 1, // COMPUTE_PREEMPTION_SUPPORTED
        91 => 0,
        92..=94 => 0,
        95 => 1,       // COOPERATIVE_LAUNCH
        96 => 0,       // COOPERATIVE_MULTI_DEVICE_LAUNCH
        97 => 166_912, // MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
        98 => 1,
        99 => 1, // HOST_REGISTER_SUPPORTED
        100 | 101 => 0,
        102 => 1, // VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
        103 => 1, // HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
        104 | 105 => 0,
        106 => 32, // MAX_BLOCKS_PER_MULTIPROCESSOR
        107 => 1,
        108 => 30 << 20,
        109 => 128 << 20,
        110 => 1,
        111 => 1024,
        112 | 113 => 1,
        114 => 1,
        115 => 1, // MEMORY_POOLS_SUPPORTED
        116 => 1,
        117 => 1,
        118 => 100,
        119 => 1,
        120 => i32::from(major >= 9), // CLUSTER_LAUNCH
        121 => 1,
        122 | 123 => 1,
        124 => 1,
        125 => 1,
        126 => 1,
        127 => i32::from(major >= 9),
        128 => 0,
        129 => 0,
        130 => 0,  // NUMA_CONFIG: none
        131 => -1, // NUMA_ID
        132 => 0,
        133 => 0,    // MPS_ENABLED
        134 => numa, // HOST_NUMA_ID
        135 => 0,
        136 | 137 => 0,
        138 => 0,
        139 => 0x20B0_10DE, // GPU_PCI_DEVICE_ID
        140 => 0x1450_10DE, // GPU_PCI_SUBSYSTEM_ID
        141..=143 => 0,
        _ => return None,
    })
}

fn total_mem(dev: CUdevice) -> Result<u64, CUresult> {
    let d = driver()?;
    let dev = d.device(dev)?;
    Ok(d.st.config.gpu[dev].memory_bytes())
}

fn uuid(out: Out<CUuuid>, dev: CUdevice) -> R {
    let d = driver()?;
    let dev = d.device(dev)?;
    out.write(CUuuid {
        bytes: d.st.config.gpu[dev].uuid_bytes(),
    })
}

exports! {
    fn cuInit(flags: c_uint) {
        init(flags)
    }
    fn cuDriverGetVersion(version: Out<i32>) {
        // Works before cuInit, as the real driver's does.
        let v = match driver() {
            Ok(d) => d.st.config.cuda_version,
            Err(_) => configured_cuda_version(),
        };
        version.write(v)
    }
    fn cuDeviceGetCount(count: Out<i32>) {
        let d = driver()?;
        count.write(d.device_count() as i32)
    }
    fn cuDeviceGet(device: Out<CUdevice>, ordinal: i32) {
        let d = driver()?;
        d.device(ordinal)?;
        device.write(ordinal)
    }
    fn cuDeviceGetName(name: OutStr, len: i32, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        name.write(len, &d.st.config.gpu[dev].name)
    }
    fn cuDeviceGetUuid(out: Out<CUuuid>, dev: CUdevice) {
        uuid(out, dev)
    }
    fn cuDeviceGetUuid_v2(out: Out<CUuuid>, dev: CUdevice) {
        uuid(out, dev)
    }
    fn cuDeviceGetLuid(luid: *mut c_char, mask: Out<c_uint>, dev: CUdevice) {
        let _ = (luid, mask);
        driver()?.device(dev)?;
        Err(CUDA_ERROR_NOT_SUPPORTED)
    }
    fn cuDeviceTotalMem(bytes: Out<c_uint>, dev: CUdevice) {
        let t = total_mem(dev)?;
        bytes.write(t.min(u64::from(u32::MAX)) as c_uint)
    }
    fn cuDeviceTotalMem_v2(bytes: Out<usize>, dev: CUdevice) {
        let t = total_mem(dev)?;
        bytes.write(t as usize)
    }
    fn cuDeviceGetAttribute(value: Out<i32>, attr: u32, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let g = &d.st.config.gpu[dev];
        let v = attribute(g, g.numa_node, attr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        value.write(v)
    }
    fn cuDeviceComputeCapability(major: Out<i32>, minor: Out<i32>, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let (ma, mi) = d.st.config.gpu[dev].cc();
        major.write(ma)?;
        minor.write(mi)
    }
    fn cuDeviceGetProperties(prop: Out<CUdevprop>, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let g = &d.st.config.gpu[dev];
        prop.write(CUdevprop {
            max_threads_per_block: 1024,
            max_threads_dim: [1024, 1024, 64],
            max_grid_size: [i32::MAX, 65535, 65535],
            shared_mem_per_block: 49152,
            total_constant_memory: 65536,
            simd_width: 32,
            mem_pitch: i32::MAX,
            regs_per_block: 65536,
            clock_rate: (g.max_sm_clock_mhz * 1000) as i32,
            texture_align: 512,
        })
    }
    fn cuDeviceGetPCIBusId(bus_id: OutStr, len: i32, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let (dom, bus, device, func) = d.st.config.gpu[dev].pci_parts();
        bus_id.write(len, &format!("{dom:08X}:{bus:02X}:{device:02X}.{func:X}"))
    }
    fn cuDeviceGetByPCIBusId(dev: Out<CUdevice>, bus_id: CStrIn) {
        let d = driver()?;
        let want = normalize_bus_id(bus_id.get()?).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let i = d
            .st
            .config
            .gpu
            .iter()
            .position(|g| normalize_bus_id(&g.pci_bus_id).as_deref() == Some(want.as_str()))
            .ok_or(CUDA_ERROR_INVALID_DEVICE)?;
        // A GPU CUDA_VISIBLE_DEVICES hides has no ordinal: INVALID_DEVICE, as for no GPU.
        dev.write(d.ordinal(i)?)
    }
    fn cuDeviceCanAccessPeer(can: Out<i32>, dev: CUdevice, peer: CUdevice) {
        let d = driver()?;
        let (a, b) = (d.device(dev)?, d.device(peer)?);
        can.write(i32::from(a != b && peer_capable(d, a, b)))
    }
    fn cuDeviceGetP2PAttribute(value: Out<i32>, attr: u32, src: CUdevice, dst: CUdevice) {
        let d = driver()?;
        let (a, b) = (d.device(src)?, d.device(dst)?);
        if a == b {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        let (pcie, nvlinks) = d.st.config.link_between(a, b);
        let ok = peer_capable(d, a, b);
        let v = match attr {
            1 => i32::from(nvlinks > 0) + (PcieLevel::System.nvml_level() - pcie.nvml_level()) as i32 / 10, // PERFORMANCE_RANK
            2 => i32::from(ok),                          // ACCESS_SUPPORTED
            3 => i32::from(ok && nvlinks > 0),           // NATIVE_ATOMIC_SUPPORTED
            4 => i32::from(ok),                          // CUDA_ARRAY_ACCESS_SUPPORTED
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        };
        value.write(v)
    }
    fn cuDeviceGetTexture1DLinearMaxWidth(width: Out<usize>, format: u32, channels: c_uint, dev: CUdevice) {
        let _ = (format, channels);
        driver()?.device(dev)?;
        width.write(1 << 28)
    }
    fn cuDeviceGetExecAffinitySupport(pi: Out<i32>, kind: u32, dev: CUdevice) {
        let _ = kind;
        driver()?.device(dev)?;
        pi.write(0)
    }
    fn cuProfilerStart() {
        driver()?;
        Ok(())
    }
    fn cuProfilerStop() {
        driver()?;
        Ok(())
    }
}

/// The CUDA version the configuration names, for `cuDriverGetVersion` before `cuInit`
/// (falls back to the built-in default's).
pub fn configured_cuda_version() -> i32 {
    std::env::var_os("GPUSIM_CONFIG")
        .and_then(|p| gpusim_core::Config::load(std::path::Path::new(&p)).ok())
        .map_or(gpusim_core::Config::default_config().cuda_version, |c| {
            c.cuda_version
        })
}
