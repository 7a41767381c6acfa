# goalloc: the two commands a newcomer needs are `make demo` and `make test`.
GO      ?= go
PYTHON  ?= python3
BUILD   := build
GOFILES := $(shell find . -name '*.go' -not -path './build/*' -not -path './.venv/*') go.mod go.sum
# What cgo compiles into the library besides Go: export's C and C++ files and
# the C ABI's header (go build's cache does not see the header change: see
# export/header_test.go).
CGOFILES := $(wildcard export/*.h export/*.c export/*.cpp) python/goalloc/csrc/goalloc.h

.PHONY: all lib tool gpubuild test testrest gotest govet goarena gorest ctest pytest stress stressbuild demo bench clean

all: lib tool

## lib: build/libgoalloc.so and its header (no CUDA toolkit needed: libcuda is dlopen'd),
## stamped with the commit it was built from where git is (the suite records it)
lib: $(BUILD)/libgoalloc.so
$(BUILD)/libgoalloc.so: $(GOFILES) $(CGOFILES)
	$(GO) build -buildvcs=auto -buildmode=c-shared -o $@ ./export

## tool: build/goalloc, the trace replay command, with goalloc's version
## (goalloc.__version__, the one place it is written) for `goalloc --version`
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"$$/\1/p' python/goalloc/__init__.py)
tool: $(BUILD)/goalloc
$(BUILD)/goalloc: $(GOFILES) python/goalloc/__init__.py
	$(GO) build -ldflags "-X main.version=$(VERSION)" -o $@ ./cmd/goalloc

## gpubuild: what tests/gpu/run_gpu.sh needs on a GPU machine that has no Go:
## the library, the replay tool and the CUDA tests of arena/ (carry build/)
gpubuild: lib tool
	$(GO) test -c -tags goalloc_cudatest -o $(BUILD)/arena.test ./arena

## test: everything CI runs, on the simulated device, no GPU needed: the Go
## tests under -race with -short (the long property and trace tests take a
## sample: `make stress` runs them in full), the C tests and the Python
## tests. About two minutes on two cores with warm caches: arena's Go tests,
## the longest, run beside all the others, and their result prints last.
test:
	@mkdir -p $(BUILD) && rm -f $(BUILD)/arena-test.log
	@$(MAKE) --no-print-directory -j3 goarena testrest ARENA_LOG=$(BUILD)/arena-test.log; \
		status=$$?; ! test -f $(BUILD)/arena-test.log || cat $(BUILD)/arena-test.log; exit $$status
testrest: govet gorest ctest
	@$(MAKE) --no-print-directory pytest

gotest: govet goarena gorest
govet:
	$(GO) vet ./...
	$(GO) vet -tags goalloc_cudatest ./arena
goarena:
	$(GO) test -race -short ./arena $(if $(ARENA_LOG),> $(ARENA_LOG) 2>&1)
gorest:
	$(GO) test -race -short $$($(GO) list ./... | grep -v '/arena$$')

## stress: the Go tests in full under -race, every seed, step and trace line
## (several minutes on two cores). On a GPU machine without Go, `make
## stressbuild` here, carry build/, and `bash tests/gpu/run_gpu.sh stress`.
stress:
	$(GO) test -race -count=1 ./...

STRESS_PKGS := arena caching replay
stressbuild:
	@mkdir -p $(BUILD)/stress
	for p in $(STRESS_PKGS); do $(GO) test -c -race -ldflags='-s -w' -o $(BUILD)/stress/$$p.test ./$$p || exit 1; done

ctest: lib
	cc -O2 -Wall -Ipython/goalloc/csrc tests/c/harness.c -o $(BUILD)/harness -ldl -lpthread
	GOALLOC_DEVICE=sim $(BUILD)/harness $(BUILD)/libgoalloc.so
	c++ -O2 -Wall -Ipython/goalloc/csrc tests/c/torch_malloc_test.cpp -o $(BUILD)/torch_malloc_test -ldl
	GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G $(BUILD)/torch_malloc_test $(BUILD)/libgoalloc.so
	cc -O2 -Wall -Ipython/goalloc/csrc tests/c/cxx_abi_test.c -o $(BUILD)/cxx_abi_test -ldl
	GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G $(BUILD)/cxx_abi_test $(BUILD)/libgoalloc.so
	c++ -O2 -Wall -std=c++17 -Ipython/goalloc/csrc tests/c/front_test.cpp -o $(BUILD)/front_test -ldl -lpthread
	GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G $(BUILD)/front_test $(BUILD)/libgoalloc.so
	c++ -O2 -Wall -std=c++17 -Ipython/goalloc/csrc tests/c/sched_test.cpp -o $(BUILD)/sched_test -ldl -lpthread
	GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G $(BUILD)/sched_test $(BUILD)/libgoalloc.so
	c++ -O1 -Wall -std=c++17 -Ipython/goalloc/csrc tests/c/split_test.cpp -o $(BUILD)/split_test
	$(BUILD)/split_test
	c++ -O1 -Wall -std=c++17 -Ipython/goalloc/csrc tests/c/ipc_test.cpp -o $(BUILD)/ipc_test -ldl
	GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G $(BUILD)/ipc_test $(BUILD)/libgoalloc.so

# pytest: the Python package as a user gets it. `pip install .` (build isolation
# on, so it fetches setuptools from PyPI) builds the library with Go into the
# package; the tests then run on the simulated device. The library reads only
# the environment the process starts with, so the settings go on the command.
VENV       := .venv
SIM_ENV    := env -u GOALLOC_CONF -u GOALLOC_LIBRARY GOALLOC_DEVICE=sim GOALLOC_SIM_DEVICES=64 \
              GOALLOC_SIM_MEMORY=8G GOALLOC_EXPECT_INSTALLED=1
$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

PIP := $(VENV)/bin/python -m pip --disable-pip-version-check
pytest: $(VENV)/bin/python
	$(PIP) install -q pytest build "setuptools>=70.1"
	env -u GOALLOC_LIBRARY $(PIP) install -q --force-reinstall --no-deps .
	$(SIM_ENV) $(VENV)/bin/python -m pytest -q tests --ignore=tests/gpu

## cxxtest: goalloc's C++ allocator class for PyTorch on the simulated device,
## compiled against torch's headers and linked to c10 alone (no GPU, no torch
## runtime). Not part of `make test`: CI has no torch. TORCH is a torch folder
## (installed or an unpacked wheel) with include/ and lib/libc10*.so;
## CUDA_INCLUDE holds the CUDA runtime headers, CUDA_LIB libcudart.
TORCH        ?= $(shell $(PYTHON) -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2>/dev/null)
CUDA_INCLUDE ?= $(or $(CUDA_HOME),/usr/local/cuda)/include
CUDA_LIB     ?= $(firstword $(wildcard $(CUDA_INCLUDE)/../lib64) $(wildcard $(CUDA_INCLUDE)/../lib))
.PHONY: cxxtest
cxxtest: lib
	@test -n "$(TORCH)" -a -f "$(TORCH)/include/c10/cuda/CUDACachingAllocator.h" || \
		{ echo "cxxtest: set TORCH to a torch folder with include/ and lib/ (found: '$(TORCH)')"; exit 2; }
	c++ -std=c++17 -O1 -Wall -D_GLIBCXX_USE_CXX11_ABI=1 -I$(TORCH)/include -I$(CUDA_INCLUDE) \
		tests/c/cxx_class_test.cpp -o $(BUILD)/cxx_class_test -ldl \
		-L$(TORCH)/lib -lc10 -lc10_cuda $(firstword $(wildcard $(CUDA_LIB)/libcudart.so*)) \
		-Wl,-rpath,$(TORCH)/lib -Wl,-rpath,$(abspath $(CUDA_LIB))
	GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G GOALLOC_SIM_DEVICES=2 $(BUILD)/cxx_class_test $(BUILD)/libgoalloc.so

## demo: the main job. With torch and a GPU: train a small transformer with
## goalloc installed. Without: replay the bundled GPT-2 trace on the simulated
## device under every policy and write report/gpt2.html.
demo: lib tool
	@if $(PYTHON) -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then \
		GOALLOC_LIBRARY=$(CURDIR)/$(BUILD)/libgoalloc.so PYTHONPATH=$(CURDIR)/python $(PYTHON) examples/train_demo.py; \
	else \
		echo "no torch with CUDA here: replaying the GPT-2 trace on the simulated device"; \
		mkdir -p report && $(BUILD)/goalloc replay --compare traces/gpt2-train.jsonl.gz --html report/gpt2.html && \
		echo "report: report/gpt2.html"; \
	fi

## bench: the cache-hit malloc+free pair from Go and through the C ABI (tag goalloc_bench),
## and through the C++ class's front (tests/c/front_bench.cpp)
bench: lib
	$(GO) test -tags goalloc_bench -run '^$$' -bench . -benchmem ./export ./caching
	c++ -O2 -Wall -std=c++17 -Ipython/goalloc/csrc tests/c/front_bench.cpp -o $(BUILD)/front_bench -ldl
	GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G $(BUILD)/front_bench $(BUILD)/libgoalloc.so

clean:
	rm -rf $(BUILD) dist python/goalloc/libgoalloc.so python/goalloc/bin python/goalloc.egg-info
