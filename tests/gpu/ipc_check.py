"""CUDA IPC under goalloc on a GPU (issue 35), through goalloc.install()
(the C++ class; the pluggable path cannot share: torch's
CUDAPluggableAllocator refuses shareIpcHandle). Prints one JSON object;
tests/gpu/test_ipc_gpu.py runs each scenario in its own process and
asserts on what it printed.

    GOALLOC_LIBRARY=build/libgoalloc.so python3 tests/gpu/ipc_check.py [SCENARIO ...]

Each scenario runs spawned children (torch.multiprocessing, spawn), with
goalloc installed or not, and records what it saw, or the error it met,
under its name, so that one failure does not hide the others:

  queue         a child receives a tensor through a Queue and writes into it;
                the parent sees the writes.
  big           the same with a 3 GiB tensor.
  many          300 small tensors (slots of goalloc's small segments, and
                blocks) in one message; the child returns their sums.
  back          the child allocates and sends to the parent, which writes;
                the child sees it.
  held          the parent frees its reference while the child holds the
                tensor, then allocates and fills same-sized tensors: the
                child's cookie is intact (no early reuse); after the child
                lets go and ipc_collect, the memory is reused.
  native_rx     a child without goalloc (PyTorch's allocator) opens
                goalloc's handle, reads and writes.
  views         PyTorch's test_cuda_simple's pattern (a 5x5 tensor and a
                view of it in one message, the child fills it), receivers
                with and without goalloc, put before and after the child
                starts.
  native_tx     children without goalloc send to the goalloc parent, with
                expandable segments ('e' handles) and without ('c').
  rl            reduce_tensor of a model's weights in the trainer, rebuild in
                a rollout process, copied into its own weights.
  exited        a handle whose sender exited: a clear error from goalloc;
                what PyTorch's allocator does with it, recorded beside.
  timing        seconds to share (reduce_tensor) and open (rebuild) 64
                tensors of 16 MiB, goalloc to goalloc, or PyTorch's allocator
                to itself with IPC_CHECK_NATIVE=1 (the whole script then
                runs without goalloc: timing alone means something there).
"""
import json
import os
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp
from torch.multiprocessing.reductions import reduce_tensor

MiB = 1 << 20


def trace_segv():
    """With SEGV_TRACE naming segv_trace.so (tests/gpu/segv_trace.c): a
    crash writes its native stack to stderr, beside faulthandler's."""
    path = os.environ.get("SEGV_TRACE")
    if path:
        import ctypes

        ctypes.CDLL(path).segv_trace_install()


def install(use_goalloc, expandable=False):
    """In a child: goalloc, or PyTorch's allocator (expandable segments or
    not), before CUDA starts."""
    trace_segv()
    if use_goalloc:
        import goalloc

        goalloc.install()
    elif expandable:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    torch.cuda.init()


def child_write(use_goalloc, q, done):
    install(use_goalloc)
    t = q.get()
    first = t[:4].tolist()
    t.fill_(42)
    torch.cuda.synchronize()
    done.put({"first": first, "backend": torch.cuda.get_allocator_backend()})
    del t
    done.get()  # the parent has checked: release then


def child_sums(q, done):
    install(True)
    ts = q.get()
    done.put([float(t.double().sum().item()) for t in ts])
    del ts


def child_send(q, back):
    install(True)
    t = torch.full((8 * MiB // 4,), 7.0, device="cuda")
    q.put(t)
    back.get()  # the parent wrote
    torch.cuda.synchronize()
    q.put(float(t.sum().item()))


def child_hold(q, done, go):
    install(True)
    t = q.get()
    go.get()  # the parent freed its reference and refilled memory
    done.put(t[:1024].tolist())
    del t
    torch.cuda.synchronize()
    done.put("released")


def child_native_send(expandable, q, back):
    install(False, expandable)
    t = torch.arange(4 * MiB, dtype=torch.float32, device="cuda")
    q.put(t)
    back.get()
    torch.cuda.synchronize()
    q.put(float(t[:16].sum().item()))


def child_rollout(q, done):
    install(True)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).cuda()
    for name, (fn, args) in q.get():
        w = fn(*args)  # rebuild_cuda_tensor: opens the trainer's handle
        model.state_dict()[name].copy_(w)
        del w
    torch.cuda.synchronize()
    done.put({k: float(v.double().sum().item()) for k, v in model.state_dict().items()})


def child_exit_after_share(q):
    install(True)
    t = torch.ones(MiB, device="cuda")
    q.put(reduce_tensor(t))
    time.sleep(1)  # then exit, the handle's process gone


def child_fill_views(use_goalloc, q, done):
    """PyTorch's test_cuda_simple, child side: fill the first of two
    tensors of one storage, say what happened."""
    install(use_goalloc)
    try:
        data = q.get(timeout=60)
        data[0][:] = 4
        torch.cuda.synchronize()
        done.put({"ok": True})
    except Exception as e:  # noqa: BLE001 - sent back to the parent
        done.put({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]})


def child_open_native(q, done):
    install(False)
    fn, args = q.get()
    try:
        fn(*args)
        done.put(None)
    except Exception as e:  # noqa: BLE001
        done.put(f"{type(e).__name__}: {e}")


def child_open_many(use_goalloc, q, done):
    install(use_goalloc)
    msgs = q.get()
    t0 = time.perf_counter()
    ts = [fn(*args) for fn, args in msgs]
    torch.cuda.synchronize()
    done.put(time.perf_counter() - t0)
    del ts


def scenario(out, name, fn):
    try:
        out[name] = fn()
    except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
        out[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}


def run(ctx, target, *args):
    p = ctx.Process(target=target, args=args)
    p.start()
    return p


def main(names):
    import goalloc
    from goalloc import _cxx

    native = os.environ.get("IPC_CHECK_NATIVE") == "1"
    if not native:
        goalloc.install()
    trace_segv()
    out = {"cxx": _cxx.installed(), "backend": torch.cuda.get_allocator_backend()}
    try:
        out["ptrace_scope"] = open("/proc/sys/kernel/yama/ptrace_scope").read().strip()
    except OSError:
        out["ptrace_scope"] = None
    ctx = mp.get_context("spawn")
    dev = torch.device("cuda", 0)
    scenarios = {}

    def write_test(nbytes, use_goalloc=True):
        q, done = ctx.Queue(), ctx.Queue()
        t = torch.arange(nbytes // 4, dtype=torch.float32, device=dev)
        p = run(ctx, child_write, use_goalloc, q, done)
        q.put(t)
        r = done.get(timeout=60)
        torch.cuda.synchronize()
        r["all_42"] = bool((t == 42).all().item())
        done.put("checked")
        p.join(60)
        r["exitcode"] = p.exitcode
        return r

    scenarios["queue"] = lambda: write_test(64 * MiB)
    scenarios["big"] = lambda: write_test(3 << 30)
    scenarios["native_rx"] = lambda: write_test(64 * MiB, use_goalloc=False)

    def views():
        # PyTorch's test_cuda_simple failed under goalloc (its child, under
        # PyTorch's allocator, never answered): a 5x5 tensor and a view of
        # it in one message, put before the child starts. Each of its
        # differences from native_rx alone: the receiver's allocator, and
        # whether the message is put before or after the child starts.
        res = {}
        for use_goalloc in (False, True):
            for put_first in (True, False):
                q, done = ctx.Queue(), ctx.Queue()
                x = torch.zeros(5, 5, device=dev)
                if put_first:
                    q.put([x, x[:, 1]])
                p = run(ctx, child_fill_views, use_goalloc, q, done)
                if not put_first:
                    q.put([x, x[:, 1]])
                try:
                    r = done.get(timeout=45)
                except Exception as e:  # noqa: BLE001
                    r = {"error": f"no answer: {type(e).__name__}"}
                torch.cuda.synchronize()
                r["filled"] = bool(x.eq(4).all().item())
                p.join(30)
                r["exitcode"] = p.exitcode
                res[f"{'goalloc' if use_goalloc else 'native'}_{'put_first' if put_first else 'start_first'}"] = r
        return res

    scenarios["views"] = views

    def many():
        q, done = ctx.Queue(), ctx.Queue()
        ts = [torch.randn((1 + i * 37) % 40000 + 1, device=dev) for i in range(300)]
        want = [float(t.double().sum().item()) for t in ts]
        p = run(ctx, child_sums, q, done)
        q.put(ts)
        got = done.get(timeout=60)
        p.join(60)
        return {"max_error": max(abs(a - b) for a, b in zip(want, got)), "n": len(got), "exitcode": p.exitcode}

    scenarios["many"] = many

    def back():
        q, b = ctx.Queue(), ctx.Queue()
        p = run(ctx, child_send, q, b)
        t = q.get(timeout=60)
        seen = float(t.sum().item())
        t.fill_(1.0)
        torch.cuda.synchronize()
        b.put("wrote")
        child_sum = q.get(timeout=60)
        del t
        p.join(60)
        return {"seen": seen, "want_seen": 7.0 * 8 * MiB / 4, "child_sum": child_sum, "want": 8 * MiB / 4,
                "exitcode": p.exitcode}

    scenarios["back"] = back

    def held():
        q, done, go = ctx.Queue(), ctx.Queue(), ctx.Queue()
        n = 32 * MiB // 4
        t = torch.arange(n, dtype=torch.float32, device=dev)
        addr = t.data_ptr()
        p = run(ctx, child_hold, q, done, go)
        q.put(t)
        time.sleep(2)  # the child has it open
        del t
        fill = [torch.full((n,), -1.0, device=dev) for _ in range(8)]
        reused_early = any(f.data_ptr() == addr for f in fill)
        torch.cuda.synchronize()
        go.put("go")
        cookie = done.get(timeout=60)
        assert done.get(timeout=60) == "released"
        p.join(60)
        del fill
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.ipc_collect()  # the block's free, held for the child until now
        freed = before - torch.cuda.memory_allocated(dev)
        return {"cookie_intact": cookie == [float(i) for i in range(1024)], "reused_early": reused_early,
                "freed_at_collect": freed, "block_bytes": n * 4, "exitcode": p.exitcode}

    scenarios["held"] = held

    def native_tx():
        res = {}
        for expandable in (True, False):
            q, b = ctx.Queue(), ctx.Queue()
            p = run(ctx, child_native_send, expandable, q, b)
            t = q.get(timeout=60)
            ok = bool((t[:1000] == torch.arange(1000, dtype=torch.float32, device=dev)).all().item())
            t[:16].fill_(2.0)
            torch.cuda.synchronize()
            b.put("wrote")
            child = q.get(timeout=60)
            del t
            p.join(60)
            res["expandable" if expandable else "cudamalloc"] = {"read_ok": ok, "child_sum": child, "want": 32.0,
                                                                  "exitcode": p.exitcode}
        return res

    scenarios["native_tx"] = native_tx

    def rl():
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(dev)
        want = {k: float(v.double().sum().item()) for k, v in model.state_dict().items()}
        q, done = ctx.Queue(), ctx.Queue()
        p = run(ctx, child_rollout, q, done)
        q.put([(k, reduce_tensor(v.detach())) for k, v in model.state_dict().items()])
        got = done.get(timeout=60)
        p.join(60)
        return {"max_error": max(abs(want[k] - got[k]) for k in want), "exitcode": p.exitcode}

    scenarios["rl"] = rl

    def exited():
        # torch's rebuild first opens the sender's CUDA event when the
        # message asks for it (its last field), then the memory handle
        # through the allocator. goalloc's part is the second: asked with
        # the event left out, it must raise. The whole message, event and
        # all, is also opened by a child under PyTorch's allocator, whose
        # outcome is recorded beside it: what torch itself does with it.
        q = ctx.Queue()
        p = run(ctx, child_exit_after_share, q)
        fn, args = q.get(timeout=60)
        p.join(60)
        assert isinstance(args[-1], bool), "rebuild_cuda_tensor's last argument is event_sync_required"
        res = {"event_sync_required": args[-1]}
        try:
            fn(*args[:-1], False)
            res["error_text"] = None
        except Exception as e:  # noqa: BLE001
            res["error_text"] = f"{type(e).__name__}: {e}"
        q2, done = ctx.Queue(), ctx.Queue()
        p2 = run(ctx, child_open_native, q2, done)
        q2.put((fn, args))
        try:
            res["native_receiver"] = done.get(timeout=60)
        except Exception as e:  # noqa: BLE001
            res["native_receiver"] = f"nothing back: {type(e).__name__}"
        p2.join(60)
        res["native_receiver_exitcode"] = p2.exitcode
        return res

    scenarios["exited"] = exited

    def timing():
        # Both sides goalloc, or both PyTorch's allocator (IPC_CHECK_NATIVE=1).
        ts = [torch.randn(16 * MiB // 4, device=dev) for _ in range(64)]
        t0 = time.perf_counter()
        msgs = [reduce_tensor(t) for t in ts]
        share = time.perf_counter() - t0
        q, done = ctx.Queue(), ctx.Queue()
        p = run(ctx, child_open_many, not native, q, done)
        q.put(msgs)
        res = {"share_s": share, "open_s": done.get(timeout=60)}
        p.join(60)
        return res

    scenarios["timing"] = timing
    unknown = set(names) - set(scenarios)
    if unknown:
        sys.exit(f"unknown scenarios {sorted(unknown)}; there are {list(scenarios)}")
    for name in names or scenarios:
        print(f"ipc_check: {name}", file=sys.stderr, flush=True)
        scenario(out, name, scenarios[name])
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
