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
    The result is also saved as GOALLOC_GPU_OUT/NAME.json, and its stderr
    as NAME.stderr.txt, when that is set. The script runs in a session of
    its own, killed whole when it ends or times out: children it spawned
    cannot keep the call waiting (they would hold a pipe open), and
    faulthandler prints the Python stack of a crash."""
    import signal
    import subprocess
    import sys
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ)
    env.setdefault("GOALLOC_LIBRARY", os.path.join(root, "build", "libgoalloc.so"))
    env["PYTHONFAULTHANDLER"] = "1"
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, os.path.join(here, script), *argv], cwd=root, env=env,
                                stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = f"timed out after {timeout} s"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    gpu_out = os.environ.get("GOALLOC_GPU_OUT")
    if gpu_out:
        with open(os.path.join(gpu_out, name + ".stderr.txt"), "w") as f:
            f.write(stderr)
    sys.stderr.write(stderr[-5000:])
    assert rc == 0, f"{script} {' '.join(argv)}: exit {rc}\n{stderr[-3000:]}"
    res = json.loads(stdout.strip().splitlines()[-1])
    if gpu_out:
        with open(os.path.join(gpu_out, name + ".json"), "w") as f:
            json.dump(res, f, indent=1)
    res["stderr"] = stderr
    return res
