// my_malloc throws where goalloc_malloc returns NULL, as PyTorch's
// allocation path expects of an allocator; a C++ caller catches it.
//   c++ -Ipython/goalloc/csrc tests/c/torch_malloc_test.cpp -o build/torch_malloc_test -ldl
//   GOALLOC_DEVICE=sim build/torch_malloc_test build/libgoalloc.so
#include <dlfcn.h>
#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <sys/types.h>

#include "open_library.h"

int main(int argc, char **argv) {
	void *lib = open_library(argc, argv);
	auto m = GOALLOC_SYMBOL(lib, my_malloc);
	auto f = GOALLOC_SYMBOL(lib, my_free);
	auto capture = GOALLOC_SYMBOL(lib, goalloc_warnings_capture);
	auto take = GOALLOC_SYMBOL(lib, goalloc_warnings_take);
	auto strfree = GOALLOC_SYMBOL(lib, goalloc_string_free);
	if (!m || !f || !capture || !take || !strfree) { std::fprintf(stderr, "missing symbols\n"); return 1; }
	// The bad calls below are expected to warn and to print one
	// out-of-memory line: the warnings are queued and the line goes to a
	// file, and both are checked instead of shown.
	capture(1);
	std::FILE *errs = std::tmpfile();
	int saved_stderr = dup(2);
	dup2(fileno(errs), 2);
	void *p = m(1 << 20, 0, nullptr);
	if (!p) { std::fprintf(stderr, "FAIL: no pointer\n"); return 1; }
	f(p, 1 << 20, 0, nullptr);
	int failures = 0;
	const struct { ssize_t size; int device; const char *want; } bad[] = {
		{-5, 0, "negative size"},
		{(ssize_t)1 << 62, 0, "CUDA out of memory. Tried to allocate more than 1EB memory."},
		{(ssize_t)1 << 40, 0, "CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has a total capacity of 8.00 GiB"},
		{64, 77, "device 77 does not exist"},
	};
	for (auto &b : bad) {
		try {
			m(b.size, b.device, nullptr);
			std::fprintf(stderr, "FAIL: size %zd on device %d did not throw\n", b.size, b.device);
			failures++;
		} catch (const std::runtime_error &e) {
			if (!std::strstr(e.what(), b.want)) {
				std::fprintf(stderr, "FAIL: message %s lacks %s\n", e.what(), b.want);
				failures++;
			}
		}
	}
	dup2(saved_stderr, 2);
	std::string printed(4096, '\0');
	std::rewind(errs);
	printed.resize(std::fread(&printed[0], 1, printed.size(), errs));
	if (!std::strstr(printed.c_str(), "goalloc: CUDA out of memory. Tried to allocate 1024.00 GiB.") ||
	    !std::strstr(printed.c_str(), "goalloc: CUDA out of memory. Tried to allocate more than 1EB memory.") ||
	    std::count(printed.begin(), printed.end(), '\n') != 2) {
		std::fprintf(stderr, "FAIL: want two out-of-memory lines on stderr, got:\n%s", printed.c_str());
		failures++;
	}
	char *warned = take();
	for (const char *kind : {"negative_size", "bad_device"}) {
		std::string pat = std::string("\"kind\":\"") + kind + "\"";
		if (!warned || !std::strstr(warned, pat.c_str())) {
			std::fprintf(stderr, "FAIL: no %s warning in %s\n", kind, warned ? warned : "(none)");
			failures++;
		}
	}
	strfree(warned);
	capture(0);
	p = m(4096, 0, nullptr);  // still works after the failures
	if (!p) failures++;
	f(p, 4096, 0, nullptr);
	std::printf("torch_malloc_test: %d failures\n", failures);
	return failures ? 1 : 0;
}
