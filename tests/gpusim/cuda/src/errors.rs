//! @generated from the CUresult enum of cuda.h (CUDA 12.9) by a one-off script; the
//! descriptions of common codes are the real driver's strings.

#![allow(dead_code)]

pub type CUresult = u32;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
pub const CUDA_ERROR_PROFILER_DISABLED: CUresult = 5;
pub const CUDA_ERROR_PROFILER_NOT_INITIALIZED: CUresult = 6;
pub const CUDA_ERROR_PROFILER_ALREADY_STARTED: CUresult = 7;
pub const CUDA_ERROR_PROFILER_ALREADY_STOPPED: CUresult = 8;
pub const CUDA_ERROR_STUB_LIBRARY: CUresult = 34;
pub const CUDA_ERROR_DEVICE_UNAVAILABLE: CUresult = 46;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_DEVICE_NOT_LICENSED: CUresult = 102;
pub const CUDA_ERROR_INVALID_IMAGE: CUresult = 200;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_CONTEXT_ALREADY_CURRENT: CUresult = 202;
pub const CUDA_ERROR_MAP_FAILED: CUresult = 205;
pub const CUDA_ERROR_UNMAP_FAILED: CUresult = 206;
pub const CUDA_ERROR_ARRAY_IS_MAPPED: CUresult = 207;
pub const CUDA_ERROR_ALREADY_MAPPED: CUresult = 208;
pub const CUDA_ERROR_NO_BINARY_FOR_GPU: CUresult = 209;
pub const CUDA_ERROR_ALREADY_ACQUIRED: CUresult = 210;
pub const CUDA_ERROR_NOT_MAPPED: CUresult = 211;
pub const CUDA_ERROR_NOT_MAPPED_AS_ARRAY: CUresult = 212;
pub const CUDA_ERROR_NOT_MAPPED_AS_POINTER: CUresult = 213;
pub const CUDA_ERROR_ECC_UNCORRECTABLE: CUresult = 214;
pub const CUDA_ERROR_UNSUPPORTED_LIMIT: CUresult = 215;
pub const CUDA_ERROR_CONTEXT_ALREADY_IN_USE: CUresult = 216;
pub const CUDA_ERROR_PEER_ACCESS_UNSUPPORTED: CUresult = 217;
pub const CUDA_ERROR_INVALID_PTX: CUresult = 218;
pub const CUDA_ERROR_INVALID_GRAPHICS_CONTEXT: CUresult = 219;
pub const CUDA_ERROR_NVLINK_UNCORRECTABLE: CUresult = 220;
pub const CUDA_ERROR_JIT_COMPILER_NOT_FOUND: CUresult = 221;
pub const CUDA_ERROR_UNSUPPORTED_PTX_VERSION: CUresult = 222;
pub const CUDA_ERROR_JIT_COMPILATION_DISABLED: CUresult = 223;
pub const CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY: CUresult = 224;
pub const CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC: CUresult = 225;
pub const CUDA_ERROR_CONTAINED: CUresult = 226;
pub const CUDA_ERROR_INVALID_SOURCE: CUresult = 300;
pub const CUDA_ERROR_FILE_NOT_FOUND: CUresult = 301;
pub const CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND: CUresult = 302;
pub const CUDA_ERROR_SHARED_OBJECT_INIT_FAILED: CUresult = 303;
pub const CUDA_ERROR_OPERATING_SYSTEM: CUresult = 304;
pub const CUDA_ERROR_INVALID_HANDLE: CUresult = 400;
pub const CUDA_ERROR_ILLEGAL_STATE: CUresult = 401;
pub const CUDA_ERROR_LOSSY_QUERY: CUresult = 402;
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_ILLEGAL_ADDRESS: CUresult = 700;
pub const CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: CUresult = 701;
pub const CUDA_ERROR_LAUNCH_TIMEOUT: CUresult = 702;
pub const CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING: CUresult = 703;
pub const CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED: CUresult = 704;
pub const CUDA_ERROR_PEER_ACCESS_NOT_ENABLED: CUresult = 705;
pub const CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE: CUresult = 708;
pub const CUDA_ERROR_CONTEXT_IS_DESTROYED: CUresult = 709;
pub const CUDA_ERROR_ASSERT: CUresult = 710;
pub const CUDA_ERROR_TOO_MANY_PEERS: CUresult = 711;
pub const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
pub const CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: CUresult = 713;
pub const CUDA_ERROR_HARDWARE_STACK_ERROR: CUresult = 714;
pub const CUDA_ERROR_ILLEGAL_INSTRUCTION: CUresult = 715;
pub const CUDA_ERROR_MISALIGNED_ADDRESS: CUresult = 716;
pub const CUDA_ERROR_INVALID_ADDRESS_SPACE: CUresult = 717;
pub const CUDA_ERROR_INVALID_PC: CUresult = 718;
pub const CUDA_ERROR_LAUNCH_FAILED: CUresult = 719;
pub const CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE: CUresult = 720;
pub const CUDA_ERROR_TENSOR_MEMORY_LEAK: CUresult = 721;
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;
pub const CUDA_ERROR_SYSTEM_NOT_READY: CUresult = 802;
pub const CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: CUresult = 803;
pub const CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE: CUresult = 804;
pub const CUDA_ERROR_MPS_CONNECTION_FAILED: CUresult = 805;
pub const CUDA_ERROR_MPS_RPC_FAILURE: CUresult = 806;
pub const CUDA_ERROR_MPS_SERVER_NOT_READY: CUresult = 807;
pub const CUDA_ERROR_MPS_MAX_CLIENTS_REACHED: CUresult = 808;
pub const CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED: CUresult = 809;
pub const CUDA_ERROR_MPS_CLIENT_TERMINATED: CUresult = 810;
pub const CUDA_ERROR_CDP_NOT_SUPPORTED: CUresult = 811;
pub const CUDA_ERROR_CDP_VERSION_MISMATCH: CUresult = 812;
pub const CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: CUresult = 900;
pub const CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: CUresult = 901;
pub const CUDA_ERROR_STREAM_CAPTURE_MERGE: CUresult = 902;
pub const CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: CUresult = 903;
pub const CUDA_ERROR_STREAM_CAPTURE_UNJOINED: CUresult = 904;
pub const CUDA_ERROR_STREAM_CAPTURE_ISOLATION: CUresult = 905;
pub const CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: CUresult = 906;
pub const CUDA_ERROR_CAPTURED_EVENT: CUresult = 907;
pub const CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: CUresult = 908;
pub const CUDA_ERROR_TIMEOUT: CUresult = 909;
pub const CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE: CUresult = 910;
pub const CUDA_ERROR_EXTERNAL_DEVICE: CUresult = 911;
pub const CUDA_ERROR_INVALID_CLUSTER_SIZE: CUresult = 912;
pub const CUDA_ERROR_FUNCTION_NOT_LOADED: CUresult = 913;
pub const CUDA_ERROR_INVALID_RESOURCE_TYPE: CUresult = 914;
pub const CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION: CUresult = 915;
pub const CUDA_ERROR_KEY_ROTATION: CUresult = 916;
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;

/// (code, name, description) for cuGetErrorName / cuGetErrorString.
pub static ERRORS: &[(CUresult, &str, &str)] = &[
    (CUDA_SUCCESS, "CUDA_SUCCESS", "no error"),
    (
        CUDA_ERROR_INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE",
        "invalid argument",
    ),
    (
        CUDA_ERROR_OUT_OF_MEMORY,
        "CUDA_ERROR_OUT_OF_MEMORY",
        "out of memory",
    ),
    (
        CUDA_ERROR_NOT_INITIALIZED,
        "CUDA_ERROR_NOT_INITIALIZED",
        "initialization error",
    ),
    (
        CUDA_ERROR_DEINITIALIZED,
        "CUDA_ERROR_DEINITIALIZED",
        "driver shutting down",
    ),
    (
        CUDA_ERROR_PROFILER_DISABLED,
        "CUDA_ERROR_PROFILER_DISABLED",
        "profiler disabled",
    ),
    (
        CUDA_ERROR_PROFILER_NOT_INITIALIZED,
        "CUDA_ERROR_PROFILER_NOT_INITIALIZED",
        "profiler not initialized",
    ),
    (
        CUDA_ERROR_PROFILER_ALREADY_STARTED,
        "CUDA_ERROR_PROFILER_ALREADY_STARTED",
        "profiler already started",
    ),
    (
        CUDA_ERROR_PROFILER_ALREADY_STOPPED,
        "CUDA_ERROR_PROFILER_ALREADY_STOPPED",
        "profiler already stopped",
    ),
    (
        CUDA_ERROR_STUB_LIBRARY,
        "CUDA_ERROR_STUB_LIBRARY",
        "stub library",
    ),
    (
        CUDA_ERROR_DEVICE_UNAVAILABLE,
        "CUDA_ERROR_DEVICE_UNAVAILABLE",
        "device unavailable",
    ),
    (
        CUDA_ERROR_NO_DEVICE,
        "CUDA_ERROR_NO_DEVICE",
        "no CUDA-capable device is detected",
    ),
    (
        CUDA_ERROR_INVALID_DEVICE,
        "CUDA_ERROR_INVALID_DEVICE",
        "invalid device ordinal",
    ),
    (
        CUDA_ERROR_DEVICE_NOT_LICENSED,
        "CUDA_ERROR_DEVICE_NOT_LICENSED",
        "device not licensed",
    ),
    (
        CUDA_ERROR_INVALID_IMAGE,
        "CUDA_ERROR_INVALID_IMAGE",
        "device kernel image is invalid",
    ),
    (
        CUDA_ERROR_INVALID_CONTEXT,
        "CUDA_ERROR_INVALID_CONTEXT",
        "invalid device context",
    ),
    (
        CUDA_ERROR_CONTEXT_ALREADY_CURRENT,
        "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
        "context already current",
    ),
    (CUDA_ERROR_MAP_FAILED, "CUDA_ERROR_MAP_FAILED", "map failed"),
    (
        CUDA_ERROR_UNMAP_FAILED,
        "CUDA_ERROR_UNMAP_FAILED",
        "unmap failed",
    ),
    (
        CUDA_ERROR_ARRAY_IS_MAPPED,
        "CUDA_ERROR_ARRAY_IS_MAPPED",
        "array is mapped",
    ),
    (
        CUDA_ERROR_ALREADY_MAPPED,
        "CUDA_ERROR_ALREADY_MAPPED",
        "already mapped",
    ),
    (
        CUDA_ERROR_NO_BINARY_FOR_GPU,
        "CUDA_ERROR_NO_BINARY_FOR_GPU",
        "no binary for gpu",
    ),
    (
        CUDA_ERROR_ALREADY_ACQUIRED,
        "CUDA_ERROR_ALREADY_ACQUIRED",
        "already acquired",
    ),
    (CUDA_ERROR_NOT_MAPPED, "CUDA_ERROR_NOT_MAPPED", "not mapped"),
    (
        CUDA_ERROR_NOT_MAPPED_AS_ARRAY,
        "CUDA_ERROR_NOT_MAPPED_AS_ARRAY",
        "not mapped as array",
    ),
    (
        CUDA_ERROR_NOT_MAPPED_AS_POINTER,
        "CUDA_ERROR_NOT_MAPPED_AS_POINTER",
        "not mapped as pointer",
    ),
    (
        CUDA_ERROR_ECC_UNCORRECTABLE,
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "ecc uncorrectable",
    ),
    (
        CUDA_ERROR_UNSUPPORTED_LIMIT,
        "CUDA_ERROR_UNSUPPORTED_LIMIT",
        "limit is not supported on this architecture",
    ),
    (
        CUDA_ERROR_CONTEXT_ALREADY_IN_USE,
        "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
        "context already in use",
    ),
    (
        CUDA_ERROR_PEER_ACCESS_UNSUPPORTED,
        "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
        "peer access unsupported",
    ),
    (
        CUDA_ERROR_INVALID_PTX,
        "CUDA_ERROR_INVALID_PTX",
        "invalid ptx",
    ),
    (
        CUDA_ERROR_INVALID_GRAPHICS_CONTEXT,
        "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT",
        "invalid graphics context",
    ),
    (
        CUDA_ERROR_NVLINK_UNCORRECTABLE,
        "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        "nvlink uncorrectable",
    ),
    (
        CUDA_ERROR_JIT_COMPILER_NOT_FOUND,
        "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        "jit compiler not found",
    ),
    (
        CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
        "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        "unsupported ptx version",
    ),
    (
        CUDA_ERROR_JIT_COMPILATION_DISABLED,
        "CUDA_ERROR_JIT_COMPILATION_DISABLED",
        "jit compilation disabled",
    ),
    (
        CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY,
        "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
        "unsupported exec affinity",
    ),
    (
        CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC,
        "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC",
        "unsupported devside sync",
    ),
    (CUDA_ERROR_CONTAINED, "CUDA_ERROR_CONTAINED", "contained"),
    (
        CUDA_ERROR_INVALID_SOURCE,
        "CUDA_ERROR_INVALID_SOURCE",
        "invalid source",
    ),
    (
        CUDA_ERROR_FILE_NOT_FOUND,
        "CUDA_ERROR_FILE_NOT_FOUND",
        "file not found",
    ),
    (
        CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND,
        "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
        "shared object symbol not found",
    ),
    (
        CUDA_ERROR_SHARED_OBJECT_INIT_FAILED,
        "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
        "shared object init failed",
    ),
    (
        CUDA_ERROR_OPERATING_SYSTEM,
        "CUDA_ERROR_OPERATING_SYSTEM",
        "operating system",
    ),
    (
        CUDA_ERROR_INVALID_HANDLE,
        "CUDA_ERROR_INVALID_HANDLE",
        "invalid resource handle",
    ),
    (
        CUDA_ERROR_ILLEGAL_STATE,
        "CUDA_ERROR_ILLEGAL_STATE",
        "the operation cannot be performed in the present state",
    ),
    (
        CUDA_ERROR_LOSSY_QUERY,
        "CUDA_ERROR_LOSSY_QUERY",
        "lossy query",
    ),
    (
        CUDA_ERROR_NOT_FOUND,
        "CUDA_ERROR_NOT_FOUND",
        "named symbol not found",
    ),
    (
        CUDA_ERROR_NOT_READY,
        "CUDA_ERROR_NOT_READY",
        "device not ready",
    ),
    (
        CUDA_ERROR_ILLEGAL_ADDRESS,
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "an illegal memory access was encountered",
    ),
    (
        CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
        "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        "launch out of resources",
    ),
    (
        CUDA_ERROR_LAUNCH_TIMEOUT,
        "CUDA_ERROR_LAUNCH_TIMEOUT",
        "launch timeout",
    ),
    (
        CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING,
        "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING",
        "launch incompatible texturing",
    ),
    (
        CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,
        "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
        "peer access is already enabled",
    ),
    (
        CUDA_ERROR_PEER_ACCESS_NOT_ENABLED,
        "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
        "peer access has not been enabled",
    ),
    (
        CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE,
        "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
        "primary context active",
    ),
    (
        CUDA_ERROR_CONTEXT_IS_DESTROYED,
        "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        "context is destroyed",
    ),
    (CUDA_ERROR_ASSERT, "CUDA_ERROR_ASSERT", "assert"),
    (
        CUDA_ERROR_TOO_MANY_PEERS,
        "CUDA_ERROR_TOO_MANY_PEERS",
        "too many peers",
    ),
    (
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
        "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        "host memory already registered",
    ),
    (
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
        "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        "host memory not registered",
    ),
    (
        CUDA_ERROR_HARDWARE_STACK_ERROR,
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "hardware stack error",
    ),
    (
        CUDA_ERROR_ILLEGAL_INSTRUCTION,
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "illegal instruction",
    ),
    (
        CUDA_ERROR_MISALIGNED_ADDRESS,
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "misaligned address",
    ),
    (
        CUDA_ERROR_INVALID_ADDRESS_SPACE,
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "invalid address space",
    ),
    (CUDA_ERROR_INVALID_PC, "CUDA_ERROR_INVALID_PC", "invalid pc"),
    (
        CUDA_ERROR_LAUNCH_FAILED,
        "CUDA_ERROR_LAUNCH_FAILED",
        "unspecified launch failure",
    ),
    (
        CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE,
        "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        "too many blocks in cooperative launch",
    ),
    (
        CUDA_ERROR_TENSOR_MEMORY_LEAK,
        "CUDA_ERROR_TENSOR_MEMORY_LEAK",
        "tensor memory leak",
    ),
    (
        CUDA_ERROR_NOT_PERMITTED,
        "CUDA_ERROR_NOT_PERMITTED",
        "operation not permitted",
    ),
    (
        CUDA_ERROR_NOT_SUPPORTED,
        "CUDA_ERROR_NOT_SUPPORTED",
        "operation not supported",
    ),
    (
        CUDA_ERROR_SYSTEM_NOT_READY,
        "CUDA_ERROR_SYSTEM_NOT_READY",
        "system not yet initialized",
    ),
    (
        CUDA_ERROR_SYSTEM_DRIVER_MISMATCH,
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        "system driver mismatch",
    ),
    (
        CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE,
        "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
        "compat not supported on device",
    ),
    (
        CUDA_ERROR_MPS_CONNECTION_FAILED,
        "CUDA_ERROR_MPS_CONNECTION_FAILED",
        "mps connection failed",
    ),
    (
        CUDA_ERROR_MPS_RPC_FAILURE,
        "CUDA_ERROR_MPS_RPC_FAILURE",
        "mps rpc failure",
    ),
    (
        CUDA_ERROR_MPS_SERVER_NOT_READY,
        "CUDA_ERROR_MPS_SERVER_NOT_READY",
        "mps server not ready",
    ),
    (
        CUDA_ERROR_MPS_MAX_CLIENTS_REACHED,
        "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
        "mps max clients reached",
    ),
    (
        CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED,
        "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
        "mps max connections reached",
    ),
    (
        CUDA_ERROR_MPS_CLIENT_TERMINATED,
        "CUDA_ERROR_MPS_CLIENT_TERMINATED",
        "mps client terminated",
    ),
    (
        CUDA_ERROR_CDP_NOT_SUPPORTED,
        "CUDA_ERROR_CDP_NOT_SUPPORTED",
        "cdp not supported",
    ),
    (
        CUDA_ERROR_CDP_VERSION_MISMATCH,
        "CUDA_ERROR_CDP_VERSION_MISMATCH",
        "cdp version mismatch",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        "stream capture unsupported",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        "operation failed due to a previous error during capture",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_MERGE,
        "CUDA_ERROR_STREAM_CAPTURE_MERGE",
        "stream capture merge",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNMATCHED,
        "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        "capture was not ended in the same stream as it began",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
        "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        "stream capture unjoined",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_ISOLATION,
        "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        "stream capture isolation",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
        "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        "stream capture implicit",
    ),
    (
        CUDA_ERROR_CAPTURED_EVENT,
        "CUDA_ERROR_CAPTURED_EVENT",
        "captured event",
    ),
    (
        CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
        "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        "stream capture wrong thread",
    ),
    (CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "timeout"),
    (
        CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE,
        "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
        "graph exec update failure",
    ),
    (
        CUDA_ERROR_EXTERNAL_DEVICE,
        "CUDA_ERROR_EXTERNAL_DEVICE",
        "external device",
    ),
    (
        CUDA_ERROR_INVALID_CLUSTER_SIZE,
        "CUDA_ERROR_INVALID_CLUSTER_SIZE",
        "invalid cluster size",
    ),
    (
        CUDA_ERROR_FUNCTION_NOT_LOADED,
        "CUDA_ERROR_FUNCTION_NOT_LOADED",
        "function not loaded",
    ),
    (
        CUDA_ERROR_INVALID_RESOURCE_TYPE,
        "CUDA_ERROR_INVALID_RESOURCE_TYPE",
        "invalid resource type",
    ),
    (
        CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION,
        "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION",
        "invalid resource configuration",
    ),
    (
        CUDA_ERROR_KEY_ROTATION,
        "CUDA_ERROR_KEY_ROTATION",
        "key rotation",
    ),
    (CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"),
];
