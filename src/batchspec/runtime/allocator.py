"""How the C allocator gives memory back: rarely, so that a forward's buffers are not faulted in again every call.

glibc's malloc serves requests of 128 KiB and more (its starting threshold) from fresh `mmap`s, and returns the
top of its heap to the system whenever more than 128 KiB of it is free (both thresholds grow a little on their own).
A forward allocates and frees the same large buffers every call (activations of a prefill, the logits of a
verification: 32 rows x 151,936 float32 are 19 MB), so each call pays page faults again: measured here (Xeon, 2
threads) `F.rms_norm` of 140 x 1536 bfloat16 values took 694 us with the defaults and 91 us with memory kept;
on an AMD EPYC (AVX2) an rms_norm and two elementwise ops on 140 x 6144 float32 values 1,456-1,631 us against
541-689, with ~200,000 minor page faults per 500 calls against none.
Keeping up to `KEEP_BYTES` free at the top of the heap, and serving requests of up to `MMAP_FROM_BYTES` from it,
removes that; the cost is that much memory held after the buffers are freed. Called once models are loaded
(`Engine`), so loading's large temporaries still go back to the system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

KEEP_BYTES = 256 << 20  # free memory kept at the top of the heap
MMAP_FROM_BYTES = 32 << 20  # requests this large or larger get their own mmap (glibc's largest allowed threshold)


@functools.cache  # once per process: every Engine calls it
def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above. Returns whether it took effect (False off Linux or with another C library)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # no glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_FROM_BYTES)) & bool(mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES))
