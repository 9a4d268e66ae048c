"""Process memory readings shared by the benchmarks (Linux /proc)."""


def rss_kib(field: str) -> int:
    """A field of /proc/self/status in KiB, e.g. VmRSS or VmHWM (the peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (False where the kernel does not allow it)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
