"""libgoalloc.so through ctypes alone, for the GPU check scripts: they test
the library itself, so they install it into torch by hand, the way the README
shows, rather than through the Python package.

    from rawlib import RawGoalloc
    g = RawGoalloc()          # $GOALLOC_LIBRARY, else build/libgoalloc.so
    g.install(torch)          # every hook, CUDA graphs included
    g.stats()["num_ooms"]; g.fragmentation(); g.snapshot()
"""
import ctypes
import json
import os

# (setter on torch's pluggable allocator, function of libgoalloc.so)
HOOKS = (
    ("set_init_fn", "goalloc_init"),
    ("set_reset_fn", "goalloc_empty_cache"),
    ("set_memory_fraction_fn", "goalloc_set_memory_fraction"),
    ("set_record_stream_fn", "goalloc_record_stream"),
    ("set_begin_allocate_to_pool", "goalloc_begin_allocate_to_pool"),
    ("set_end_allocate_to_pool_fn", "goalloc_end_allocate_to_pool"),
    ("set_release_pool", "goalloc_release_pool"),
)


class RawGoalloc:
    def __init__(self, path=None):
        self.path = os.path.abspath(path or os.environ.get("GOALLOC_LIBRARY", "build/libgoalloc.so"))
        self.lib = ctypes.CDLL(self.path)
        for name in ("goalloc_stats_json", "goalloc_fragmentation_json", "goalloc_snapshot_json"):
            getattr(self.lib, name).restype = ctypes.c_void_p
        self.lib.goalloc_string_free.argtypes = [ctypes.c_void_p]

    def address(self, name):
        return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value

    def install(self, torch):
        """Make goalloc torch's allocator, with my_malloc (which raises where
        goalloc_malloc would return NULL) and every hook."""
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(self.path, "my_malloc", "my_free")
        hooks = pluggable.allocator()
        for setter, name in HOOKS:
            getattr(hooks, setter)(self.address(name))
        torch.cuda.memory.change_current_allocator(pluggable)
        return pluggable

    def _json(self, fn, arg):
        p = fn(arg)
        if not p:
            raise RuntimeError("goalloc returned NULL")
        try:
            return json.loads(ctypes.string_at(p).decode())
        finally:
            self.lib.goalloc_string_free(p)

    def stats(self, device=0):
        return self._json(self.lib.goalloc_stats_json, device)

    def fragmentation(self, device=0):
        return self._json(self.lib.goalloc_fragmentation_json, device)

    def snapshot(self, device=0):
        return self._json(self.lib.goalloc_snapshot_json, device)


def run_check(script, name, *argv, timeout=600):
    """Run one of the check scripts beside this file in a fresh process (the
    allocator must be installed before CUDA starts, once per process), and
    return the JSON object it prints last, with its stderr under "stderr".
    The result is also saved as GOALLOC_GPU_OUT/NAME.json when that is set."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ)
    env.setdefault("GOALLOC_LIBRARY", os.path.join(root, "build", "libgoalloc.so"))
    proc = subprocess.run([sys.executable, os.path.join(here, script), *argv], cwd=root, env=env,
                          capture_output=True, text=True, timeout=timeout)
    sys.stderr.write(proc.stderr[-5000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    out = os.environ.get("GOALLOC_GPU_OUT")
    if out:
        with open(os.path.join(out, name + ".json"), "w") as f:
            json.dump(res, f, indent=1)
    res["stderr"] = proc.stderr
    return res
