# goalloc: the two commands a newcomer needs are `make demo` and `make test`.
GO      ?= go
PYTHON  ?= python3
BUILD   := build
GOFILES := $(shell find . -name '*.go' -not -path './build/*' -not -path './.venv/*') go.mod go.sum

.PHONY: all lib tool test gotest ctest pytest demo bench clean

all: lib tool

## lib: build/libgoalloc.so and its header (no CUDA toolkit needed: libcuda is dlopen'd)
lib: $(BUILD)/libgoalloc.so
$(BUILD)/libgoalloc.so: $(GOFILES)
	$(GO) build -buildmode=c-shared -o $@ ./export

## tool: build/goalloc, the trace replay command
tool: $(BUILD)/goalloc
$(BUILD)/goalloc: $(GOFILES)
	$(GO) build -o $@ ./cmd/goalloc

## test: everything CI runs, on the simulated device, no GPU needed
test: gotest ctest pytest

gotest:
	$(GO) vet ./...
	$(GO) test -race ./...

ctest: lib
	cc -O2 -Wall tests/c/harness.c -o $(BUILD)/harness -ldl -lpthread
	GOALLOC_DEVICE=sim $(BUILD)/harness $(BUILD)/libgoalloc.so

pytest: lib
	@echo "(python tests: see the pytest target once the package lands)"

## bench: the cache-hit malloc+free pair from Go and through the C ABI (tag goalloc_bench)
bench:
	$(GO) test -tags goalloc_bench -run '^$$' -bench . -benchmem ./export ./caching

clean:
	rm -rf $(BUILD)
