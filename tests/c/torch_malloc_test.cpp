// my_malloc throws where goalloc_malloc returns NULL, as PyTorch's
// allocation path expects of an allocator; a C++ caller catches it.
//   c++ tests/c/torch_malloc_test.cpp -o build/torch_malloc_test -ldl
//   GOALLOC_DEVICE=sim build/torch_malloc_test build/libgoalloc.so
#include <dlfcn.h>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <sys/types.h>

typedef void *(*malloc_fn)(ssize_t, int, void *);
typedef void (*free_fn)(void *, ssize_t, int, void *);

int main(int argc, char **argv) {
	if (argc != 2) return 2;
	void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	if (!lib) { std::fprintf(stderr, "%s\n", dlerror()); return 1; }
	auto m = (malloc_fn)dlsym(lib, "my_malloc");
	auto f = (free_fn)dlsym(lib, "my_free");
	if (!m || !f) { std::fprintf(stderr, "missing symbols\n"); return 1; }
	void *p = m(1 << 20, 0, nullptr);
	if (!p) { std::fprintf(stderr, "FAIL: no pointer\n"); return 1; }
	f(p, 1 << 20, 0, nullptr);
	int failures = 0;
	const struct { ssize_t size; int device; const char *want; } bad[] = {
		{-5, 0, "negative size"},
		{(ssize_t)1 << 62, 0, "larger than any device"},
		{(ssize_t)1 << 40, 0, "out of memory on device 0"},
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
	p = m(4096, 0, nullptr);  // still works after the failures
	if (!p) failures++;
	f(p, 4096, 0, nullptr);
	std::printf("torch_malloc_test: %d failures\n", failures);
	return failures ? 1 : 0;
}
