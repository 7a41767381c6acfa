// my_malloc is goalloc_malloc for PyTorch: where goalloc_malloc returns
// NULL, it throws. PyTorch 2.11 does not check the pointer a pluggable
// allocator returns: a NULL becomes a tensor that looks made, and the first
// kernel that touches it faults and breaks the CUDA context for the whole
// process (seen on the H200: cudaErrorIllegalAddress after an over-cap
// request). An exception thrown here instead unwinds through PyTorch's
// allocation path, which is written for allocators that throw on
// out-of-memory, and reaches Python as a RuntimeError carrying goalloc's own
// message, before any kernel runs. It cannot be torch's OutOfMemoryError:
// this library is built without torch's headers (goalloc's C++ allocator
// class, python/goalloc/csrc, throws that one). It is thrown here, after Go
// has returned: an exception must never unwind through Go frames. C callers
// use goalloc_malloc.
#include <stdexcept>
#include <string>

#include "goalloc.h"  // declares my_malloc, which this defines

extern "C" {
void *my_malloc(ssize_t size, int device, void *stream) {
	void *p = goalloc_malloc(size, device, stream);
	if (p == nullptr) {
		char *e = goalloc_last_error();
		std::string msg = e != nullptr && *e != '\0' ? e : "goalloc: allocation failed";
		goalloc_string_free(e);
		throw std::runtime_error(msg);
	}
	return p;
}
}
