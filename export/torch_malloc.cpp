// goalloc_torch_malloc is my_malloc for PyTorch: where my_malloc returns
// NULL, it throws. PyTorch 2.11 does not check the pointer a pluggable
// allocator returns: a NULL becomes a tensor that looks made, and the first
// kernel that touches it faults and breaks the CUDA context for the whole
// process (seen on the H200: cudaErrorIllegalAddress after an over-cap
// request). An exception thrown here instead unwinds through PyTorch's
// allocation path, which is written for allocators that throw on
// out-of-memory, and reaches Python as a RuntimeError carrying goalloc's own
// message, before any kernel runs. The Python package installs this symbol;
// my_malloc stays the plain C ABI.
#include <stdexcept>
#include <string>
#include <sys/types.h>

extern "C" {
void *my_malloc(ssize_t size, int device, void *stream);
char *goalloc_last_error(void);
void goalloc_string_free(char *s);

void *goalloc_torch_malloc(ssize_t size, int device, void *stream) {
	void *p = my_malloc(size, device, stream);
	if (p == nullptr) {
		char *e = goalloc_last_error();
		std::string msg = e != nullptr && *e != '\0' ? e : "goalloc: allocation failed";
		goalloc_string_free(e);
		throw std::runtime_error(msg);
	}
	return p;
}
}
