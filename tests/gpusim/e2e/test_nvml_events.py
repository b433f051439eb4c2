"""XID events through pynvml: `gpusim inject-xid` in one process, nvmlEventSetWait in another.

nvmlEventSetWait must deliver an XID raised after registration promptly (it sleeps on the
state file's XID counter, not a polling loop), must not deliver XIDs raised before
registration or on devices not registered, and must time out with NVML_ERROR_TIMEOUT.
"""

import json
import sys
import textwrap
import time

PRELUDE = textwrap.dedent(
    """
    import json, subprocess, sys, time
    import pynvml as N

    def out(x):
        print(json.dumps(x), flush=True)

    def wait(es, ms):
        t0 = time.monotonic()
        try:
            e = N.nvmlEventSetWait(es, ms)
        except N.NVMLError as err:
            return dict(error=err.value, elapsed=time.monotonic() - t0)
        return dict(
            xid=e.eventData, type=e.eventType, gpu=N.nvmlDeviceGetIndex(e.device),
            gi=e.gpuInstanceId, ci=e.computeInstanceId, elapsed=time.monotonic() - t0,
        )

    N.nvmlInit()
    h = [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]
    es = N.nvmlEventSetCreate()
    """
)

XID = 0x8  # nvmlEventTypeXidCriticalError
TIMEOUT = 10  # NVML_ERROR_TIMEOUT


def test_nvml_xid_wakes_a_blocked_waiter(sim):
    waiter = sim.popen(
        [
            sys.executable,
            "-c",
            PRELUDE
            + textwrap.dedent(
                """
                for d in h:
                    N.nvmlDeviceRegisterEvents(d, N.nvmlEventTypeXidCriticalError, es)
                out("ready")
                out(wait(es, 5000))
                N.nvmlEventSetFree(es)
                """
            ),
        ]
    )
    try:
        assert waiter.stdout.readline().strip() == '"ready"'
        time.sleep(0.3)  # let it block in nvmlEventSetWait
        sent = time.monotonic()
        sim.gpusim("inject-xid", "1", "79")
        line = waiter.stdout.readline()
        got = time.monotonic()
        assert waiter.wait(timeout=10) == 0, waiter.stderr.read()
    finally:
        if waiter.poll() is None:
            waiter.kill()
    r = json.loads(line)
    assert (r["xid"], r["type"], r["gpu"]) == (79, XID, 1)
    assert (r["gi"], r["ci"]) == (0xFFFFFFFF, 0xFFFFFFFF)
    # it was woken by the XID, well before its 5 s timeout
    assert r["elapsed"] < 4.0, r
    assert got - sent < 4.0


def test_nvml_xids_before_registration_are_not_delivered(sim):
    sim.gpusim("inject-xid", "0", "79")
    sim.gpusim("inject-xid", "0", "13")
    p = sim.python(
        PRELUDE
        + textwrap.dedent(
            """
            N.nvmlDeviceRegisterEvents(h[0], N.nvmlEventTypeXidCriticalError, es)
            first = wait(es, 300)
            subprocess.run(["gpusim", "inject-xid", "0", "48"], check=True, capture_output=True)
            subprocess.run(["gpusim", "inject-xid", "0", "31"], check=True, capture_output=True)
            out([first, wait(es, 5000), wait(es, 5000), wait(es, 0)])
            N.nvmlEventSetFree(es)
            """
        )
    )
    first, a, b, last = json.loads(p.stdout)
    assert first["error"] == TIMEOUT
    # each later XID is delivered once, in order, without waiting
    assert (a["xid"], a["gpu"]) == (48, 0)
    assert (b["xid"], b["gpu"]) == (31, 0)
    assert a["elapsed"] < 1.0 and b["elapsed"] < 1.0
    assert last["error"] == TIMEOUT


def test_nvml_unregistered_devices_and_timeouts(sim):
    p = sim.python(
        PRELUDE
        + textwrap.dedent(
            """
            supported = N.nvmlDeviceGetSupportedEventTypes(h[0])
            N.nvmlDeviceRegisterEvents(h[0], N.nvmlEventTypeXidCriticalError, es)
            subprocess.run(["gpusim", "inject-xid", "1", "79"], check=True, capture_output=True)
            other_gpu = wait(es, 400)
            try:
                N.nvmlDeviceRegisterEvents(h[1], N.nvmlEventTypePState, es)
                unsupported = 0
            except N.NVMLError as e:
                unsupported = e.value
            # registering GPU 1 now does not bring back its earlier XID
            N.nvmlDeviceRegisterEvents(h[1], N.nvmlEventTypeXidCriticalError, es)
            late = wait(es, 200)
            N.nvmlEventSetFree(es)
            out(dict(supported=supported, other_gpu=other_gpu, unsupported=unsupported, late=late))
            """
        )
    )
    r = json.loads(p.stdout)
    assert r["supported"] == 0x8 | 0x1 | 0x2  # Xid | SingleBitEcc | DoubleBitEcc
    assert r["other_gpu"]["error"] == TIMEOUT
    assert r["other_gpu"]["elapsed"] >= 0.39
    assert r["unsupported"] == 3  # NVML_ERROR_NOT_SUPPORTED
    assert r["late"]["error"] == TIMEOUT


def test_nvml_event_set_handles_are_validated(sim):
    p = sim.python(
        PRELUDE
        + textwrap.dedent(
            """
            import ctypes
            lib = N.nvmlLib
            data = N.c_nvmlEventData_t()
            N.nvmlEventSetFree(es)
            out(dict(
                wait_freed=lib.nvmlEventSetWait_v2(es, ctypes.byref(data), 0),
                free_twice=lib.nvmlEventSetFree(es),
                bogus=lib.nvmlEventSetWait_v2(ctypes.c_void_p(0x1234), ctypes.byref(data), 0),
                register_null=lib.nvmlDeviceRegisterEvents(h[0], ctypes.c_ulonglong(8), None),
            ))
            """
        )
    )
    r = json.loads(p.stdout)
    assert r == dict(wait_freed=2, free_twice=2, bogus=2, register_null=2)  # NVML_ERROR_INVALID_ARGUMENT
