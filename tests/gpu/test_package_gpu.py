"""The Python package's warnings and its wheel on a real GPU (skipped
without CUDA).

- A bad free raised on torch's autograd thread, while goalloc is torch's
  allocator, reaches Python as goalloc.GoallocWarning through the library's
  notifier, training goes on, and nothing deadlocks.
- The wheel built where Go is (`python -m build`, then carry dist/) installs
  with pip into a venv here (pip accepts its manylinux tag on this glibc),
  and goalloc from that wheel, with no GOALLOC_LIBRARY, is torch's allocator;
  its `goalloc` command runs. Skipped when no wheel was brought.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from scenarios import ROOT, child_env  # noqa: E402

WARNING_FROM_AUTOGRAD = """
import ctypes, json, threading, time, warnings
warnings.simplefilter("always")
caught = []
warnings.showwarning = lambda m, c, *a, **k: caught.append([c.__name__, str(m), threading.current_thread().name])
import goalloc, torch
goalloc.install()
from goalloc import _lib
L = _lib.lib()
hook_threads = []

def bad_free(grad):
    # On torch's autograd device thread: a free of a pointer goalloc never made.
    hook_threads.append(threading.current_thread().name)
    L.my_free(0x1234, 512, 0, None)
    return grad

model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).cuda()
opt = torch.optim.AdamW(model.parameters())
for step in range(20):
    x = torch.randn(64, 512, device="cuda", requires_grad=True)
    if step == 3:
        x.register_hook(bad_free)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
torch.cuda.synchronize()
deadline = time.monotonic() + 10
while not caught and time.monotonic() < deadline:
    time.sleep(0.01)
print("RESULT " + json.dumps({"caught": caught, "hook_threads": hook_threads, "loss": loss.item(),
                              "unknown_pointer": goalloc.memory_stats(0).get("goalloc.bad_input.unknown_pointer")}))
"""


def test_a_warning_raised_on_the_autograd_thread_reaches_python():
    proc = subprocess.run([sys.executable, "-c", WARNING_FROM_AUTOGRAD], env=child_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1][7:])
    print(json.dumps(result))
    assert result["hook_threads"], "the hook ran"
    assert result["unknown_pointer"] == 1
    messages = [m for c, m, _ in result["caught"] if c == "GoallocWarning"]
    assert len(messages) == 1 and "free of 0x1234" in messages[0], result
    assert "0x1234" not in proc.stderr, "a warning, not a stderr line"


def _wheel() -> Path:
    wheels = sorted((ROOT / "dist").glob("goalloc-*.whl"))
    if not wheels:
        pytest.skip("no wheel in dist/: run `python -m build` where Go is and bring dist/ along")
    return wheels[-1]


def test_the_wheel_installs_here_and_is_torchs_allocator(tmp_path):
    wheel = _wheel()
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False, system_site_packages=True)  # torch from the system
    py = env_dir / "bin" / "python"
    # The interpreter running this may itself be a venv (the GPU machine's
    # python3 is): system_site_packages reaches only the base interpreter's
    # packages, so point the new venv at this one's site-packages too.
    child_site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    Path(child_site, "_parent_site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GOALLOC_LIBRARY", "GOALLOC_TOOL", "PYTHONPATH")}
    env["GOALLOC_DEVICE"] = "cuda"
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                              "--no-index", str(wheel)], env=env, capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, f"pip refused {wheel.name} here:\n{install.stdout}{install.stderr}"
    check = subprocess.run([str(py), "-c", textwrap.dedent("""
        import json, goalloc, torch
        goalloc.install()
        x = torch.randn(1024, 1024, device="cuda")
        print(json.dumps([goalloc.library_path(), torch.cuda.memory_allocated(), goalloc.memory_allocated(0)]))
        """)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    path, torch_allocated, goalloc_allocated = json.loads(check.stdout.splitlines()[-1])
    assert Path(path).is_relative_to(env_dir)
    assert torch_allocated == goalloc_allocated >= 4 << 20
    tool = subprocess.run([str(env_dir / "bin" / "goalloc"), "help", "replay"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert tool.returncode == 0 and "Usage: goalloc replay" in tool.stdout, tool.stderr
    print(f"{wheel.name}: installed and ran here")
