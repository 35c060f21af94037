"""DeviceMemory facts as the probe returns them, for placement tests without hosts."""

GB = 10**9
GiB = 1 << 30


def cpu(total, available):
    return {"rpc_cache.DeviceMemory": {"cpu": {"total": total, "available": available,
                                               "source": "/proc/meminfo"}}}


def mac(memsize, metal_free, estimated, available):
    return {"rpc_cache.DeviceMemory": {
        "cpu": {"total": memsize, "available": available, "source": "sysctl hw.memsize"},
        "metal": {"total": metal_free, "free": metal_free, "estimated": estimated}}}


def cuda(free):
    return {"rpc_cache.DeviceMemory": {"cpu": None, "cuda": [{"total": free + GB // 2,
                                                              "free": free}]}}
