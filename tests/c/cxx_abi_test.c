/* The C calls of goalloc's C++ allocator class for PyTorch (goalloc.h),
 * from C on the simulated device: a refused goalloc_pool_malloc hands back
 * its message and whether it was an out-of-memory; goalloc_free_ptr frees by
 * pointer alone; the DeviceStats figures; a pool's users, live blocks and a
 * checkpoint set back. goalloc_malloc, the C entry point, returns NULL.
 * NULL where a call needs a pointer is refused (goalloc.h, "Conventions"):
 * goalloc_configure(NULL) leaves GOALLOC_CONF in force, and
 * goalloc_torch_device_stats into NULL writes nothing.
 *
 *   cc -Ipython/goalloc/csrc tests/c/cxx_abi_test.c -o build/cxx_abi_test -ldl
 *   GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G build/cxx_abi_test build/libgoalloc.so
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "open_library.h"
#include "stderr_file.h"
#include "expect.h"

typedef unsigned long long ull;

int main(int argc, char **argv) {
	void *lib = open_library(argc, argv);
	GOALLOC_FN(goalloc_init) init = GOALLOC_SYMBOL(lib, goalloc_init);
	GOALLOC_FN(goalloc_malloc) cmalloc = GOALLOC_SYMBOL(lib, goalloc_malloc);
	GOALLOC_FN(goalloc_pool_malloc) pm = GOALLOC_SYMBOL(lib, goalloc_pool_malloc);
	GOALLOC_FN(goalloc_free_ptr) fp = GOALLOC_SYMBOL(lib, goalloc_free_ptr);
	GOALLOC_FN(goalloc_torch_device_stats) dstats = GOALLOC_SYMBOL(lib, goalloc_torch_device_stats);
	GOALLOC_FN(goalloc_largest_cached_block) largest = GOALLOC_SYMBOL(lib, goalloc_largest_cached_block);
	GOALLOC_FN(goalloc_create_or_incref_pool) incref = GOALLOC_SYMBOL(lib, goalloc_create_or_incref_pool);
	GOALLOC_FN(goalloc_pool_use_count) users = GOALLOC_SYMBOL(lib, goalloc_pool_use_count);
	GOALLOC_FN(goalloc_begin_allocate_to_pool) begin = GOALLOC_SYMBOL(lib, goalloc_begin_allocate_to_pool);
	GOALLOC_FN(goalloc_end_allocate_to_pool) end = GOALLOC_SYMBOL(lib, goalloc_end_allocate_to_pool);
	GOALLOC_FN(goalloc_release_pool) release = GOALLOC_SYMBOL(lib, goalloc_release_pool);
	GOALLOC_FN(goalloc_pool_live_blocks) live = GOALLOC_SYMBOL(lib, goalloc_pool_live_blocks);
	GOALLOC_FN(goalloc_restore_pool) restore = GOALLOC_SYMBOL(lib, goalloc_restore_pool);
	GOALLOC_FN(goalloc_string_free) sfree = GOALLOC_SYMBOL(lib, goalloc_string_free);
	GOALLOC_FN(goalloc_warnings_capture) capture = GOALLOC_SYMBOL(lib, goalloc_warnings_capture);
	GOALLOC_FN(goalloc_warnings_take) take = GOALLOC_SYMBOL(lib, goalloc_warnings_take);
	GOALLOC_FN(goalloc_configure) configure = GOALLOC_SYMBOL(lib, goalloc_configure);
	GOALLOC_FN(goalloc_last_error_kind) kind = GOALLOC_SYMBOL(lib, goalloc_last_error_kind);
	if (!init || !cmalloc || !pm || !fp || !dstats || !largest || !incref || !users || !begin || !end ||
	    !release || !live || !restore || !sfree || !capture || !take || !configure || !kind) {
		fprintf(stderr, "cxx_abi_test: missing symbol\n");
		return 1;
	}
	/* The bad calls below warn: queued and checked at the end, not printed. */
	capture(1);
	/* goalloc_configure(NULL) is refused as a bad argument (kind 1), not
	 * taken as "": GOALLOC_CONF, read at initialisation, keeps its cap of
	 * 4 GiB of the 8 (checked below). */
	setenv("GOALLOC_CONF", "fraction:0.5", 1);
	EXPECT(configure(NULL) == -1 && kind() == GOALLOC_ERROR_bad_argument, "configure(NULL): kind %d", kind());
	init(1);
	void *const S = (void *)0x10;

	/* goalloc_malloc: NULL for a refusal, never an exception. */
	EXPECT(cmalloc(-5, 0, S) == NULL, "negative size");
	stderr_to_file(); /* the refusal prints its out-of-memory line, as PyTorch's would */
	void *big = cmalloc((ssize_t)1 << 40, 0, S);
	int printed = stderr_back("goalloc: CUDA out of memory. Tried to allocate 1024.00 GiB.");
	EXPECT(big == NULL, "out of memory");
	EXPECT(printed == 1, "%d out-of-memory lines on stderr, not 1", printed);

	/* goalloc_pool_malloc: the message, and whether it was an out-of-memory. */
	struct { size_t size; ull pool; int oom; const char *want; } refused[] = {
		{(size_t)1 << 40, 0, 1, "CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0"},
		{(size_t)1 << 62, 0, 1, "CUDA out of memory. Tried to allocate more than 1EB memory."},
		{(size_t)1 << 63, 0, 0, "a negative size?"},
		{64, 12345, 0, "not in use"},
	};
	for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
		int oom = -1;
		char *err = NULL;
		void *q = pm(refused[i].size, 0, S, 0, refused[i].pool, &oom, &err);
		EXPECT(q == NULL && oom == (refused[i].oom ? 1 : -1) && err && strstr(err, refused[i].want),
		       "size %zu pool %llu: %p oom %d err %s", refused[i].size, refused[i].pool, q, oom, err ? err : "(null)");
		if (err) sfree(err);
	}

	/* The DeviceStats figures. */
	long long f[GOALLOC_TORCH_STAT_FIGURES];
	const int allocated = STAT_FIGURE(allocated_bytes); /* allocated_bytes.all.current */
	void *p = pm(3000000, 0, S, 0, 0, NULL, NULL);
	EXPECT(p != NULL, "malloc");
	EXPECT(dstats(0, f, GOALLOC_TORCH_STAT_FIGURES) == 0 && f[allocated] == 3000320, "allocated_bytes.all.current %lld",
	       f[allocated]);
	EXPECT(dstats(0, f, GOALLOC_TORCH_STAT_FIGURES - 1) == -1, "a wrong figure count is refused");
	EXPECT(dstats(0, NULL, GOALLOC_TORCH_STAT_FIGURES) == -1 && kind() == GOALLOC_ERROR_bad_argument, "no buffer is refused: kind %d", kind());
	EXPECT(fp(p) == 0, "free by pointer");
	EXPECT(fp(p) == -1, "a double free is refused");
	EXPECT(fp(NULL) == 0, "an empty tensor's deleter");
	EXPECT(largest(0) >= 3000320, "the freed block is cached: %lld", largest(0));

	/* GOALLOC_CONF's cap survived goalloc_configure(NULL). */
	int oom = 0;
	EXPECT(pm((size_t)5 << 30, 0, S, 0, 0, &oom, NULL) == NULL && oom == 1, "5 GiB over the cap of 4: oom %d", oom);

	/* A pool: users, live blocks, a checkpoint set back. */
	EXPECT(incref(0, 0, 7) == 0 && users(0, 0, 7) == 1, "made");
	begin(0, 0, 7, NULL);
	EXPECT(users(0, 0, 7) == 2, "window");
	void *a = pm(1 << 20, 0, S, 0, 7, NULL, NULL);
	void *b = pm(1000, 0, S, 0, 7, NULL, NULL);
	end(0, 0, 7);
	release(0, 0, 7);
	char *rows = live(0, 0, 7);
	char want[256];
	snprintf(want, sizeof want, "[%llu,1048576,1048576,16]", (ull)a);
	EXPECT(rows && strstr(rows, want), "live blocks %s lack %s", rows ? rows : "(null)", want);
	sfree(rows);
	ull checkpoint[4] = {(ull)a, 1 << 20, 1 << 20, 0x10};
	EXPECT(fp(a) == 0 && fp(b) == 0, "freed into the pool");
	char *res = restore(0, 0, 7, checkpoint, 1);
	EXPECT(res && strstr(res, "\"freed\":[]") && strstr(res, "\"error\":\"\""), "restore: %s", res ? res : "(null)");
	sfree(res);
	rows = live(0, 0, 7);
	snprintf(want, sizeof want, "[[%llu,1048576,1048576,16]]", (ull)a);
	EXPECT(rows && strcmp(rows, want) == 0, "after restore %s, want %s", rows ? rows : "(null)", want);
	sfree(rows);
	EXPECT(restore(0, 9, 9, checkpoint, 1) == NULL, "a pool not in use");
	EXPECT(fp(a) == 0, "the restored block frees");
	release(0, 0, 7);
	EXPECT(users(0, 0, 7) == 0, "released");

	char *warned = take();
	EXPECT(warned && strstr(warned, "\"kind\":\"double_free\"") && strstr(warned, "\"kind\":\"invalid_argument\"") &&
	           strstr(warned, "\"kind\":\"null_pointer\""),
	       "the expected warnings: %s", warned ? warned : "(none)");
	sfree(warned);
	capture(0);
	printf("cxx_abi_test: %d failures\n", failures);
	return failures ? 1 : 0;
}
