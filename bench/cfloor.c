// c-floor: the least a PyTorch pluggable allocator can do, as a yardstick.
//
// The benchmark suite (bench/suite.py) loads this library into PyTorch with
// torch.cuda.memory.CUDAPluggableAllocator(path, "cfloor_malloc", "cfloor_free")
// to measure what torch's pluggable-allocator path costs by itself: an
// allocator that does next to nothing, so that any time above it is the
// real allocator's own. It is compiled on the GPU machine with gcc:
//
//     gcc -O2 -shared -fPIC -o libcfloor.so bench/cfloor.c -ldl -lpthread
//
// What it does, and nothing more:
//   - requests are rounded up to 512 bytes;
//   - a freed block goes onto a free list keyed by exact (device, stream,
//     rounded size), and a request with the same key takes the last one
//     freed; a miss calls cuMemAlloc. Keying by the stream keeps reuse in
//     stream order, as torch's own allocator does: a block freed on stream A
//     is only handed out again for stream A, where A's earlier kernels are
//     ordered before the new owner's;
//   - Tensor.record_stream(s) is honoured: a block used on other streams goes,
//     when freed, onto a pending list with one event recorded on each of those
//     streams, and returns to its free list once every event has completed
//     (checked on a free-list miss only);
//   - when cuMemAlloc runs out of memory, every cached block is freed and the
//     allocation tried once more; if that fails too it prints why and aborts
//     (torch 2.11 does not check a NULL from a pluggable allocator, and a NULL
//     tensor would fail far from the cause).
// Nothing is ever split or merged, and cached memory is never given back
// except by cfloor_empty_cache (torch.cuda.empty_cache) or the retry above.
// One mutex guards everything.
//
// No CUDA header or toolkit is needed: libcuda.so.1 is opened with dlopen
// (CFLOOR_LIBCUDA names another library, which the tests use for a fake
// driver) and the few driver types are declared here, as in arena/cuda.go.

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

enum { CU_OK = 0, CU_OOM = 2, CU_NOT_READY = 600, CU_EVENT_DISABLE_TIMING = 2 };
enum { MAX_DEVICES = 64, ROUND = 512, BUCKETS = 4096, MAX_STREAMS = 8 };

static CUresult (*p_cuInit)(unsigned int);
static CUresult (*p_cuDeviceGet)(CUdevice *, int);
static CUresult (*p_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*p_cuCtxGetCurrent)(CUcontext *);
static CUresult (*p_cuCtxSetCurrent)(CUcontext);
static CUresult (*p_cuCtxSynchronize)(void);
static CUresult (*p_cuMemAlloc)(CUdeviceptr *, size_t);
static CUresult (*p_cuMemFree)(CUdeviceptr);
static CUresult (*p_cuEventCreate)(CUevent *, unsigned int);
static CUresult (*p_cuEventRecord)(CUevent, CUstream);
static CUresult (*p_cuEventQuery)(CUevent);

// A free list: the cached blocks of one (device, stream, size), a stack.
typedef struct node {
	CUdeviceptr ptr;
	struct node *next;
} node;

typedef struct sizelist {
	int device;
	CUstream stream;
	size_t size;
	node *head;
	struct sizelist *next; // hash chain
} sizelist;

// The streams a live block was recorded on with Tensor.record_stream.
typedef struct recorded {
	CUdeviceptr ptr;
	int nstreams;
	CUstream streams[MAX_STREAMS];
	struct recorded *next; // hash chain, or the spare list
} recorded;

// A freed block waiting for events on other streams.
typedef struct pending {
	CUdeviceptr ptr;
	sizelist *list; // where it goes once every event has completed
	int nevents;
	CUevent events[MAX_STREAMS];
	struct pending *next;
} pending;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int load_status = -1; // 0 once libcuda is loaded and initialised
static char load_error[512];

static sizelist *lists[BUCKETS];
static recorded *recorded_map[BUCKETS];
static long long recorded_count; // live blocks with record_stream streams
static recorded *spare_recorded;
static node *spare_nodes;
static pending *pending_head;
static CUevent *spare_events;
static size_t spare_events_len, spare_events_cap;
static CUcontext primary[MAX_DEVICES];
static __thread CUcontext thread_ctx;

// Statistics, read by cfloor_stats: bytes held from cuMemAlloc and bytes
// handed out (rounded sizes), each current and peak, and call counts.
static long long reserved_cur, reserved_peak, allocated_cur, allocated_peak;
static long long device_allocs, device_frees, cache_hits, cache_misses;

static void load(void) {
	const char *path = getenv("CFLOOR_LIBCUDA");
	if (path == NULL || *path == '\0') path = "libcuda.so.1";
	void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (lib == NULL) {
		const char *e = dlerror();
		snprintf(load_error, sizeof load_error, "cfloor: cannot open %s: %s", path, e ? e : "?");
		load_status = 1;
		return;
	}
	struct { void **dst; const char *name; } syms[] = {
		{ (void **)&p_cuInit, "cuInit" },
		{ (void **)&p_cuDeviceGet, "cuDeviceGet" },
		{ (void **)&p_cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain" },
		{ (void **)&p_cuCtxGetCurrent, "cuCtxGetCurrent" },
		{ (void **)&p_cuCtxSetCurrent, "cuCtxSetCurrent" },
		{ (void **)&p_cuCtxSynchronize, "cuCtxSynchronize" },
		{ (void **)&p_cuMemAlloc, "cuMemAlloc_v2" },
		{ (void **)&p_cuMemFree, "cuMemFree_v2" },
		{ (void **)&p_cuEventCreate, "cuEventCreate" },
		{ (void **)&p_cuEventRecord, "cuEventRecord" },
		{ (void **)&p_cuEventQuery, "cuEventQuery" },
	};
	for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
		*syms[i].dst = dlsym(lib, syms[i].name);
		if (*syms[i].dst == NULL) {
			snprintf(load_error, sizeof load_error, "cfloor: %s has no symbol %s", path, syms[i].name);
			load_status = 2;
			return;
		}
	}
	CUresult r = p_cuInit(0);
	if (r != CU_OK) {
		snprintf(load_error, sizeof load_error, "cfloor: cuInit failed: %d", r);
		load_status = 3;
		return;
	}
	load_status = 0;
}

static void fail(const char *what, CUresult r) {
	fprintf(stderr, "cfloor: %s failed (CUresult %d)\n", what, r);
	abort();
}

static void ensure_loaded(void) {
	pthread_once(&once, load);
	if (load_status != 0) {
		fprintf(stderr, "%s\n", load_error);
		abort();
	}
}

// ensure_context makes sure the calling thread has a current context: on
// PyTorch's autograd thread none is current at first (stream-ordered calls
// there fail with CUDA_ERROR_INVALID_CONTEXT).
// Called with mu held.
static void ensure_context(int device) {
	if (thread_ctx != NULL) return;
	CUcontext c = NULL;
	CUresult r = p_cuCtxGetCurrent(&c);
	if (r != CU_OK) fail("cuCtxGetCurrent", r);
	if (c == NULL) {
		if (device < 0 || device >= MAX_DEVICES) fail("device index", -1);
		if (primary[device] == NULL) {
			CUdevice dev;
			if ((r = p_cuDeviceGet(&dev, device)) != CU_OK) fail("cuDeviceGet", r);
			if ((r = p_cuDevicePrimaryCtxRetain(&primary[device], dev)) != CU_OK) fail("cuDevicePrimaryCtxRetain", r);
		}
		c = primary[device];
		if ((r = p_cuCtxSetCurrent(c)) != CU_OK) fail("cuCtxSetCurrent", r);
	}
	thread_ctx = c;
}

static size_t hash_key(uintptr_t a, uintptr_t b, uintptr_t c) {
	uint64_t h = (uint64_t)a * 0x9E3779B97F4A7C15ull ^ (uint64_t)b * 0xC2B2AE3D27D4EB4Full ^ (uint64_t)c;
	h ^= h >> 29;
	return (size_t)(h % BUCKETS);
}

// find_list returns the free list of (device, stream, size), making it if
// create is set.
static sizelist *find_list(int device, CUstream stream, size_t size, int create) {
	size_t b = hash_key(size, (uintptr_t)stream, (uintptr_t)device);
	for (sizelist *l = lists[b]; l != NULL; l = l->next)
		if (l->size == size && l->stream == stream && l->device == device) return l;
	if (!create) return NULL;
	sizelist *l = calloc(1, sizeof *l);
	if (l == NULL) fail("calloc", -1);
	l->device = device;
	l->stream = stream;
	l->size = size;
	l->next = lists[b];
	lists[b] = l;
	return l;
}

static void push(sizelist *l, CUdeviceptr p) {
	node *n = spare_nodes;
	if (n != NULL) {
		spare_nodes = n->next;
	} else if ((n = malloc(sizeof *n)) == NULL) {
		fail("malloc", -1);
	}
	n->ptr = p;
	n->next = l->head;
	l->head = n;
}

static CUdeviceptr pop(sizelist *l) {
	node *n = l->head;
	if (n == NULL) return 0;
	l->head = n->next;
	n->next = spare_nodes;
	spare_nodes = n;
	return n->ptr;
}

// poll_pending moves the pending blocks whose events have all completed
// back to their free lists.
static void poll_pending(void) {
	pending **pp = &pending_head;
	while (*pp != NULL) {
		pending *p = *pp;
		int done = 1;
		for (int i = 0; i < p->nevents; i++) {
			CUresult r = p_cuEventQuery(p->events[i]);
			if (r == CU_NOT_READY) {
				done = 0;
				break;
			}
			if (r != CU_OK) fail("cuEventQuery", r);
		}
		if (!done) {
			pp = &p->next;
			continue;
		}
		for (int i = 0; i < p->nevents; i++) {
			if (spare_events_len == spare_events_cap) {
				size_t cap = spare_events_cap ? 2 * spare_events_cap : 64;
				CUevent *e = realloc(spare_events, cap * sizeof *e);
				if (e == NULL) fail("realloc", -1);
				spare_events = e;
				spare_events_cap = cap;
			}
			spare_events[spare_events_len++] = p->events[i];
		}
		push(p->list, p->ptr);
		*pp = p->next;
		free(p);
	}
}

// release_cached frees every cached block (not the pending ones), after
// waiting for the device, and returns how many bytes it gave back.
static long long release_cached(void) {
	CUresult r = p_cuCtxSynchronize();
	if (r != CU_OK) fail("cuCtxSynchronize", r);
	poll_pending();
	long long freed = 0;
	for (size_t b = 0; b < BUCKETS; b++) {
		for (sizelist *l = lists[b]; l != NULL; l = l->next) {
			CUdeviceptr p;
			while ((p = pop(l)) != 0) {
				if ((r = p_cuMemFree(p)) != CU_OK) fail("cuMemFree", r);
				device_frees++;
				reserved_cur -= (long long)l->size;
				freed += (long long)l->size;
			}
		}
	}
	return freed;
}

static CUevent get_event(void) {
	if (spare_events_len > 0) return spare_events[--spare_events_len];
	CUevent e;
	CUresult r = p_cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
	if (r != CU_OK) fail("cuEventCreate", r);
	return e;
}

static recorded *take_recorded(CUdeviceptr ptr) {
	recorded **pp = &recorded_map[hash_key(ptr, 0, 0)];
	for (; *pp != NULL; pp = &(*pp)->next) {
		if ((*pp)->ptr == ptr) {
			recorded *r = *pp;
			*pp = r->next;
			recorded_count--;
			return r;
		}
	}
	return NULL;
}

// --- the functions PyTorch calls -------------------------------------------

void *cfloor_malloc(ssize_t size, int device, CUstream stream) {
	if (size <= 0) return NULL;
	size_t n = ((size_t)size + ROUND - 1) / ROUND * ROUND;
	ensure_loaded();
	pthread_mutex_lock(&mu);
	ensure_context(device);
	sizelist *l = find_list(device, stream, n, 1);
	CUdeviceptr p = pop(l);
	if (p != 0) {
		cache_hits++;
	} else {
		cache_misses++;
		if (pending_head != NULL) {
			poll_pending();
			p = pop(l);
		}
		if (p == 0) {
			CUresult r = p_cuMemAlloc(&p, n);
			if (r == CU_OOM) {
				long long freed = release_cached();
				r = p_cuMemAlloc(&p, n);
				if (r != CU_OK) {
					fprintf(stderr,
						"cfloor: out of memory on device %d: %zu bytes requested; %lld bytes reserved, "
						"%lld allocated, %lld just released from the cache (CUresult %d)\n",
						device, n, reserved_cur, allocated_cur, freed, r);
					abort();
				}
			} else if (r != CU_OK) {
				fail("cuMemAlloc", r);
			}
			device_allocs++;
			reserved_cur += (long long)n;
			if (reserved_cur > reserved_peak) reserved_peak = reserved_cur;
		}
	}
	allocated_cur += (long long)n;
	if (allocated_cur > allocated_peak) allocated_peak = allocated_cur;
	pthread_mutex_unlock(&mu);
	return (void *)(uintptr_t)p;
}

// cfloor_free gets the stream the block was allocated on (torch passes it).
void cfloor_free(void *ptr, ssize_t size, int device, CUstream stream) {
	if (ptr == NULL || size <= 0) return;
	size_t n = ((size_t)size + ROUND - 1) / ROUND * ROUND;
	CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
	pthread_mutex_lock(&mu);
	ensure_context(device);
	sizelist *l = find_list(device, stream, n, 1);
	allocated_cur -= (long long)n;
	recorded *rec = recorded_count > 0 ? take_recorded(p) : NULL;
	if (rec == NULL) {
		push(l, p);
	} else {
		pending *pe = calloc(1, sizeof *pe);
		if (pe == NULL) fail("calloc", -1);
		pe->ptr = p;
		pe->list = l;
		for (int i = 0; i < rec->nstreams; i++) {
			CUevent e = get_event();
			CUresult r = p_cuEventRecord(e, rec->streams[i]);
			if (r != CU_OK) fail("cuEventRecord", r);
			pe->events[pe->nevents++] = e;
		}
		pe->next = pending_head;
		pending_head = pe;
		rec->next = spare_recorded;
		spare_recorded = rec;
	}
	pthread_mutex_unlock(&mu);
}

// cfloor_record_stream: Tensor.record_stream(stream) on a live block.
// Recording the block's own stream is harmless: its event completes in
// stream order before any later work on that stream.
void cfloor_record_stream(void *ptr, CUstream stream) {
	CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
	if (p == 0) return;
	pthread_mutex_lock(&mu);
	size_t b = hash_key(p, 0, 0);
	recorded *r = recorded_map[b];
	while (r != NULL && r->ptr != p) r = r->next;
	if (r == NULL) {
		r = spare_recorded;
		if (r != NULL) {
			spare_recorded = r->next;
		} else if ((r = malloc(sizeof *r)) == NULL) {
			fail("malloc", -1);
		}
		r->ptr = p;
		r->nstreams = 0;
		r->next = recorded_map[b];
		recorded_map[b] = r;
		recorded_count++;
	}
	int seen = 0;
	for (int i = 0; i < r->nstreams; i++) seen |= r->streams[i] == stream;
	if (!seen) {
		if (r->nstreams == MAX_STREAMS) {
			fprintf(stderr, "cfloor: more than %d streams recorded on one block\n", MAX_STREAMS);
			abort();
		}
		r->streams[r->nstreams++] = stream;
	}
	pthread_mutex_unlock(&mu);
}

// cfloor_init is torch's init hook; loading happens on first use anyway.
void cfloor_init(int device_count) {
	(void)device_count;
	ensure_loaded();
}

// cfloor_empty_cache is torch.cuda.empty_cache().
void cfloor_empty_cache(void) {
	ensure_loaded();
	pthread_mutex_lock(&mu);
	ensure_context(0);
	release_cached();
	pthread_mutex_unlock(&mu);
}

// cfloor_stats fills out[0..7]: reserved current and peak, allocated
// current and peak (bytes), device allocations, device frees, cache hits,
// cache misses.
void cfloor_stats(long long out[8]) {
	pthread_mutex_lock(&mu);
	long long v[8] = { reserved_cur, reserved_peak, allocated_cur, allocated_peak,
		device_allocs, device_frees, cache_hits, cache_misses };
	memcpy(out, v, sizeof v);
	pthread_mutex_unlock(&mu);
}

// cfloor_reset_peaks sets both peaks to their current values.
void cfloor_reset_peaks(void) {
	pthread_mutex_lock(&mu);
	reserved_peak = reserved_cur;
	allocated_peak = allocated_cur;
	pthread_mutex_unlock(&mu);
}
