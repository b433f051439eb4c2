//! Telemetry: utilization (device, per process, sample buffers), and the sensors derived from
//! the last sample period's utilization `u` (0..=100): temperature, power, energy, clocks,
//! performance state, throttle reasons. PCIe counters, ECC counters and fans have fixed
//! answers. Every figure comes from gpusim-core's timeline, so all processes agree.

use std::ffi::{c_uint, c_ulonglong};

use gpusim_core::state::mem_util_of;
use gpusim_core::GpuConfig;

use crate::ffi::{Buf, Out};
use crate::types::*;
use crate::{dev, sim_err, Dev};

/// Board power of an idle GPU, mW.
const IDLE_POWER_MW: u64 = 55_000;
/// Graphics/SM clock of an idle GPU, MHz.
const IDLE_SM_CLOCK: c_uint = 210;
/// Video clock of an idle GPU, MHz.
const IDLE_VIDEO_CLOCK: c_uint = 795;

nvml_api! {
    /// `gpu`: percent of the last complete sample period in which a kernel ran; `memory`:
    /// gpusim's fixed fraction of it (gpusim does not model memory traffic).
    fn nvmlDeviceGetUtilizationRates(device: nvmlDevice_t, utilization: Out<nvmlUtilization_t>) {
        let v = dev(device)?.view()?;
        utilization.write(nvmlUtilization_t { gpu: v.sm_util, memory: v.mem_util })
    }

    /// Samples newer than `lastSeenTimeStamp` (wall-clock µs), one per process per sample
    /// period in which it ran, newest first. NULL `utilization` asks for the count
    /// (`NVML_ERROR_INSUFFICIENT_SIZE`); none newer is `NVML_ERROR_NOT_FOUND`.
    fn nvmlDeviceGetProcessUtilization(
        device: nvmlDevice_t,
        utilization: Buf<nvmlProcessUtilizationSample_t>,
        processSamplesCount: Out<c_uint>,
        lastSeenTimeStamp: c_ulonglong,
    ) {
        let d = dev(device)?;
        let cap = processSamplesCount.read()? as usize;
        let samples = d.st.process_samples(d.g, lastSeenTimeStamp).map_err(sim_err)?;
        if samples.is_empty() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        if utilization.is_null() || samples.len() > cap {
            processSamplesCount.write(samples.len() as c_uint)?;
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        let items: Vec<_> = samples
            .iter()
            .map(|s| nvmlProcessUtilizationSample_t {
                pid: s.pid,
                timeStamp: s.timestamp_us,
                smUtil: s.sm_util,
                memUtil: s.mem_util,
                encUtil: 0,
                decUtil: 0,
            })
            .collect();
        utilization.write_all(&items, cap)?;
        processSamplesCount.write(items.len() as c_uint)
    }

    /// The versioned form of [`nvmlDeviceGetProcessUtilization`]: the caller sets `version`,
    /// `processSamplesCount`, `lastSeenTimeStamp` and `procUtilArray`.
    fn nvmlDeviceGetProcessesUtilizationInfo(device: nvmlDevice_t, procesesUtilInfo: Out<nvmlProcessesUtilizationInfo_t>) {
        let d = dev(device)?;
        let mut info = procesesUtilInfo.read()?;
        if info.version != nvmlProcessesUtilizationInfo_v1 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        let samples = d.st.process_samples(d.g, info.lastSeenTimeStamp).map_err(sim_err)?;
        if samples.is_empty() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        let cap = info.processSamplesCount as usize;
        info.processSamplesCount = samples.len() as c_uint;
        if info.procUtilArray.is_null() || samples.len() > cap {
            procesesUtilInfo.write(info)?;
            return Err(NVML_ERROR_INSUFFICIENT_SIZE);
        }
        let items: Vec<_> = samples
            .iter()
            .map(|s| nvmlProcessUtilizationInfo_v1_t {
                timeStamp: s.timestamp_us,
                pid: s.pid,
                smUtil: s.sm_util,
                memUtil: s.mem_util,
                encUtil: 0,
                decUtil: 0,
                jpgUtil: 0,
                ofaUtil: 0,
            })
            .collect();
        info.procUtilArray.write_all(&items, cap)?;
        procesesUtilInfo.write(info)
    }

    /// GPU and memory utilization samples (one per sample period, oldest first, as
    /// `unsigned int`); other sample types are not simulated. NULL `samples` asks for the
    /// count; a smaller buffer gets the oldest samples that fit.
    fn nvmlDeviceGetSamples(
        device: nvmlDevice_t,
        r#type: nvmlSamplingType_t,
        lastSeenTimeStamp: c_ulonglong,
        sampleValType: Out<nvmlValueType_t>,
        sampleCount: Out<c_uint>,
        samples: Buf<nvmlSample_t>,
    ) {
        let d = dev(device)?;
        let cap = sampleCount.read()? as usize;
        if r#type >= NVML_SAMPLINGTYPE_COUNT {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        if r#type != NVML_GPU_UTILIZATION_SAMPLES && r#type != NVML_MEMORY_UTILIZATION_SAMPLES {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        if sampleValType.is_null() || (!samples.is_null() && cap == 0) {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let list = d.st.device_samples(d.g, lastSeenTimeStamp).map_err(sim_err)?;
        if list.is_empty() {
            return Err(NVML_ERROR_NOT_FOUND);
        }
        sampleValType.write(NVML_VALUE_TYPE_UNSIGNED_INT)?;
        if samples.is_null() {
            return sampleCount.write(list.len() as c_uint);
        }
        let memory = r#type == NVML_MEMORY_UTILIZATION_SAMPLES;
        let items: Vec<nvmlSample_t> = list
            .iter()
            .take(cap)
            .map(|&(ts, pct)| nvmlSample_t {
                timeStamp: ts,
                sampleValue: nvmlValue_t::uint(if memory { mem_util_of(pct) } else { pct }),
            })
            .collect();
        samples.write_all(&items, cap)?;
        sampleCount.write(items.len() as c_uint)
    }

    /// gpusim has no video engines: 0 %, over the sample period.
    fn nvmlDeviceGetEncoderUtilization(device: nvmlDevice_t, utilization: Out<c_uint>, samplingPeriodUs: Out<c_uint>) {
        let d = dev(device)?;
        codec_utilization(&d, utilization, samplingPeriodUs)
    }

    fn nvmlDeviceGetDecoderUtilization(device: nvmlDevice_t, utilization: Out<c_uint>, samplingPeriodUs: Out<c_uint>) {
        let d = dev(device)?;
        codec_utilization(&d, utilization, samplingPeriodUs)
    }

    // ---- temperature -------------------------------------------------------------------

    /// 33 °C idle, rising 0.45 °C per percent of utilization.
    fn nvmlDeviceGetTemperature(device: nvmlDevice_t, sensorType: nvmlTemperatureSensors_t, temp: Out<c_uint>) {
        let d = dev(device)?;
        if sensorType != NVML_TEMPERATURE_GPU {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        temp.write(temperature(d.util()?))
    }

    fn nvmlDeviceGetTemperatureV(device: nvmlDevice_t, temperature: Out<nvmlTemperature_t>) {
        let d = dev(device)?;
        let mut t = temperature.read()?;
        if t.version != nvmlTemperature_v1 {
            return Err(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
        }
        if t.sensorType != NVML_TEMPERATURE_GPU {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        t.temperature = self::temperature(d.util()?) as i32;
        temperature.write(t)
    }

    fn nvmlDeviceGetTemperatureThreshold(device: nvmlDevice_t, thresholdType: nvmlTemperatureThresholds_t, temp: Out<c_uint>) {
        dev(device)?;
        let t = match thresholdType {
            NVML_TEMPERATURE_THRESHOLD_SHUTDOWN => 92,
            NVML_TEMPERATURE_THRESHOLD_SLOWDOWN => 89,
            NVML_TEMPERATURE_THRESHOLD_MEM_MAX => 95,
            NVML_TEMPERATURE_THRESHOLD_GPU_MAX => 87,
            t if t < NVML_TEMPERATURE_THRESHOLD_COUNT => return Err(NVML_ERROR_NOT_SUPPORTED),
            _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
        };
        temp.write(t)
    }

    // ---- power -------------------------------------------------------------------------

    fn nvmlDeviceGetPowerManagementMode(device: nvmlDevice_t, mode: Out<nvmlEnableState_t>) {
        dev(device)?;
        mode.write(NVML_FEATURE_ENABLED)
    }

    /// mW: 55 W idle plus u % of the rest of the power limit.
    fn nvmlDeviceGetPowerUsage(device: nvmlDevice_t, power: Out<c_uint>) {
        let d = dev(device)?;
        power.write(power_mw(d.cfg(), d.util()?))
    }

    fn nvmlDeviceGetPowerManagementLimit(device: nvmlDevice_t, limit: Out<c_uint>) {
        limit.write(limit_mw(dev(device)?.cfg()))
    }

    fn nvmlDeviceGetEnforcedPowerLimit(device: nvmlDevice_t, limit: Out<c_uint>) {
        limit.write(limit_mw(dev(device)?.cfg()))
    }

    fn nvmlDeviceGetPowerManagementDefaultLimit(device: nvmlDevice_t, defaultLimit: Out<c_uint>) {
        defaultLimit.write(limit_mw(dev(device)?.cfg()))
    }

    /// 100 W (or the limit, if lower) up to the configured limit.
    fn nvmlDeviceGetPowerManagementLimitConstraints(device: nvmlDevice_t, minLimit: Out<c_uint>, maxLimit: Out<c_uint>) {
        let d = dev(device)?;
        if minLimit.is_null() || maxLimit.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let max = limit_mw(d.cfg());
        minLimit.write(max.min(100_000))?;
        maxLimit.write(max)
    }

    /// mJ since boot: idle power all along plus the extra power of every busy ns, so it only
    /// grows.
    fn nvmlDeviceGetTotalEnergyConsumption(device: nvmlDevice_t, energy: Out<c_ulonglong>) {
        let d = dev(device)?;
        let v = d.view()?;
        energy.write(energy_mj(d.cfg(), v.time_ns, v.busy_ns))
    }

    // ---- clocks and performance state --------------------------------------------------

    /// SM/graphics: the maximum while busy, 210 MHz idle; memory: always its maximum.
    fn nvmlDeviceGetClockInfo(device: nvmlDevice_t, r#type: nvmlClockType_t, clock: Out<c_uint>) {
        let d = dev(device)?;
        let mhz = current_clock(d.cfg(), r#type, d.util()?)?;
        clock.write(mhz)
    }

    fn nvmlDeviceGetMaxClockInfo(device: nvmlDevice_t, r#type: nvmlClockType_t, clock: Out<c_uint>) {
        let d = dev(device)?;
        clock.write(max_clock(d.cfg(), r#type)?)
    }

    fn nvmlDeviceGetApplicationsClock(device: nvmlDevice_t, clockType: nvmlClockType_t, clockMHz: Out<c_uint>) {
        let d = dev(device)?;
        clockMHz.write(max_clock(d.cfg(), clockType)?)
    }

    fn nvmlDeviceGetDefaultApplicationsClock(device: nvmlDevice_t, clockType: nvmlClockType_t, clockMHz: Out<c_uint>) {
        let d = dev(device)?;
        clockMHz.write(max_clock(d.cfg(), clockType)?)
    }

    fn nvmlDeviceGetClock(device: nvmlDevice_t, clockType: nvmlClockType_t, clockId: nvmlClockId_t, clockMHz: Out<c_uint>) {
        let d = dev(device)?;
        let mhz = match clockId {
            NVML_CLOCK_ID_CURRENT => current_clock(d.cfg(), clockType, d.util()?)?,
            NVML_CLOCK_ID_APP_CLOCK_TARGET | NVML_CLOCK_ID_APP_CLOCK_DEFAULT | NVML_CLOCK_ID_CUSTOMER_BOOST_MAX => {
                max_clock(d.cfg(), clockType)?
            }
            _ => return Err(NVML_ERROR_INVALID_ARGUMENT),
        };
        clockMHz.write(mhz)
    }

    /// P0 while busy, P8 idle.
    fn nvmlDeviceGetPerformanceState(device: nvmlDevice_t, pState: Out<nvmlPstates_t>) {
        let d = dev(device)?;
        pState.write(pstate(d.util()?))
    }

    fn nvmlDeviceGetPowerState(device: nvmlDevice_t, pState: Out<nvmlPstates_t>) {
        let d = dev(device)?;
        pState.write(pstate(d.util()?))
    }

    /// None while busy; `nvmlClocksEventReasonGpuIdle` when idle (as real GPUs report).
    fn nvmlDeviceGetCurrentClocksEventReasons(device: nvmlDevice_t, clocksEventReasons: Out<c_ulonglong>) {
        let d = dev(device)?;
        clocksEventReasons.write(clocks_event_reasons(d.util()?))
    }

    fn nvmlDeviceGetCurrentClocksThrottleReasons(device: nvmlDevice_t, clocksThrottleReasons: Out<c_ulonglong>) {
        let d = dev(device)?;
        clocksThrottleReasons.write(clocks_event_reasons(d.util()?))
    }

    fn nvmlDeviceGetSupportedClocksEventReasons(device: nvmlDevice_t, supportedClocksEventReasons: Out<c_ulonglong>) {
        dev(device)?;
        supportedClocksEventReasons.write(SUPPORTED_CLOCKS_EVENT_REASONS)
    }

    fn nvmlDeviceGetSupportedClocksThrottleReasons(device: nvmlDevice_t, supportedClocksThrottleReasons: Out<c_ulonglong>) {
        dev(device)?;
        supportedClocksThrottleReasons.write(SUPPORTED_CLOCKS_EVENT_REASONS)
    }

    // ---- fans, PCIe, ECC ---------------------------------------------------------------

    /// Data-center boards are passively cooled: no fan to report.
    fn nvmlDeviceGetFanSpeed(device: nvmlDevice_t, _speed: Out<c_uint>) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    fn nvmlDeviceGetFanSpeed_v2(device: nvmlDevice_t, _fan: c_uint, _speed: Out<c_uint>) {
        dev(device)?;
        Err(NVML_ERROR_NOT_SUPPORTED)
    }

    fn nvmlDeviceGetCurrPcieLinkGeneration(device: nvmlDevice_t, currLinkGen: Out<c_uint>) {
        dev(device)?;
        currLinkGen.write(4)
    }

    fn nvmlDeviceGetMaxPcieLinkGeneration(device: nvmlDevice_t, maxLinkGen: Out<c_uint>) {
        dev(device)?;
        maxLinkGen.write(4)
    }

    fn nvmlDeviceGetCurrPcieLinkWidth(device: nvmlDevice_t, currLinkWidth: Out<c_uint>) {
        dev(device)?;
        currLinkWidth.write(16)
    }

    fn nvmlDeviceGetMaxPcieLinkWidth(device: nvmlDevice_t, maxLinkWidth: Out<c_uint>) {
        dev(device)?;
        maxLinkWidth.write(16)
    }

    /// KB/s over the last 20 ms: gpusim moves no data over PCIe.
    fn nvmlDeviceGetPcieThroughput(device: nvmlDevice_t, counter: nvmlPcieUtilCounter_t, value: Out<c_uint>) {
        dev(device)?;
        if counter >= NVML_PCIE_UTIL_COUNT {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        value.write(0)
    }

    fn nvmlDeviceGetPcieReplayCounter(device: nvmlDevice_t, value: Out<c_uint>) {
        dev(device)?;
        value.write(0)
    }

    fn nvmlDeviceGetTotalEccErrors(
        device: nvmlDevice_t,
        errorType: nvmlMemoryErrorType_t,
        counterType: nvmlEccCounterType_t,
        eccCounts: Out<c_ulonglong>,
    ) {
        dev(device)?;
        if errorType >= NVML_MEMORY_ERROR_TYPE_COUNT || counterType >= NVML_ECC_COUNTER_TYPE_COUNT {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        eccCounts.write(0)
    }
}

fn codec_utilization(d: &Dev, utilization: Out<c_uint>, period: Out<c_uint>) -> NvmlResult {
    if utilization.is_null() || period.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    utilization.write(0)?;
    period.write(d.st.config.sample_period_us as c_uint)
}

fn temperature(u: u32) -> c_uint {
    33 + (u * 45 + 50) / 100
}

fn limit_mw(c: &GpuConfig) -> c_uint {
    c.power_limit_w.saturating_mul(1000)
}

fn power_mw(c: &GpuConfig, u: u32) -> c_uint {
    let limit = u64::from(limit_mw(c));
    let idle = IDLE_POWER_MW.min(limit);
    (idle + (limit - idle) * u64::from(u.min(100)) / 100) as c_uint
}

/// mJ = W × ms: idle power over the whole uptime plus the extra power while busy.
fn energy_mj(c: &GpuConfig, time_ns: u64, busy_ns: u64) -> u64 {
    let limit = u64::from(limit_mw(c));
    let idle = IDLE_POWER_MW.min(limit);
    // mW × ns / 1e9 = mJ
    ((u128::from(idle) * u128::from(time_ns) + u128::from(limit - idle) * u128::from(busy_ns))
        / 1_000_000_000) as u64
}

fn video_max(c: &GpuConfig) -> c_uint {
    c.max_sm_clock_mhz * 9 / 10
}

fn max_clock(c: &GpuConfig, t: nvmlClockType_t) -> Result<c_uint, nvmlReturn_t> {
    match t {
        NVML_CLOCK_GRAPHICS | NVML_CLOCK_SM => Ok(c.max_sm_clock_mhz),
        NVML_CLOCK_MEM => Ok(c.max_mem_clock_mhz),
        NVML_CLOCK_VIDEO => Ok(video_max(c)),
        _ => Err(NVML_ERROR_INVALID_ARGUMENT),
    }
}

fn current_clock(c: &GpuConfig, t: nvmlClockType_t, u: u32) -> Result<c_uint, nvmlReturn_t> {
    let max = max_clock(c, t)?;
    Ok(match t {
        _ if u > 0 => max,
        NVML_CLOCK_GRAPHICS | NVML_CLOCK_SM => IDLE_SM_CLOCK.min(max),
        NVML_CLOCK_VIDEO => IDLE_VIDEO_CLOCK.min(max),
        _ => max,
    })
}

fn pstate(u: u32) -> nvmlPstates_t {
    if u > 0 {
        NVML_PSTATE_0
    } else {
        NVML_PSTATE_8
    }
}

fn clocks_event_reasons(u: u32) -> c_ulonglong {
    if u > 0 {
        0
    } else {
        nvmlClocksEventReasonGpuIdle
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpusim_core::Config;

    #[test]
    fn sensors_follow_utilization() {
        let c = &Config::default_config().gpu[0];
        assert_eq!(temperature(0), 33);
        assert_eq!(temperature(100), 78);
        assert_eq!(power_mw(c, 0), 55_000);
        assert_eq!(power_mw(c, 100), 400_000);
        assert_eq!(power_mw(c, 50), 227_500);
        assert_eq!(current_clock(c, NVML_CLOCK_SM, 0), Ok(210));
        assert_eq!(current_clock(c, NVML_CLOCK_SM, 1), Ok(1410));
        assert_eq!(current_clock(c, NVML_CLOCK_MEM, 0), Ok(1215));
        assert_eq!(current_clock(c, 9, 0), Err(NVML_ERROR_INVALID_ARGUMENT));
        assert_eq!(pstate(0), NVML_PSTATE_8);
        assert_eq!(pstate(3), NVML_PSTATE_0);
    }

    #[test]
    fn energy_grows_with_time_and_work() {
        let c = &Config::default_config().gpu[0];
        // one second idle: 55 J; one busy second adds the other 345 J
        assert_eq!(energy_mj(c, 1_000_000_000, 0), 55_000);
        assert_eq!(energy_mj(c, 1_000_000_000, 1_000_000_000), 400_000);
        assert!(energy_mj(c, 2_000_000_000, 0) > energy_mj(c, 1_000_000_000, 0));
    }
}
