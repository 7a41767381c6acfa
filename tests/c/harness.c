/* Loads libgoalloc.so with dlopen, as PyTorch does, and calls it from two
 * threads at once on the simulated device (GOALLOC_DEVICE=sim). Checks what a
 * C caller can see: every pointer is non-NULL, 512-byte aligned and disjoint
 * from every other live pointer of both threads; bad input returns NULL or is
 * ignored without crashing; the statistics add up at the end.
 *
 *   cc -Ipython/goalloc/csrc tests/c/harness.c -o build/harness -ldl -lpthread
 *   GOALLOC_DEVICE=sim build/harness build/libgoalloc.so
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "open_library.h"
#include "stderr_file.h"

static GOALLOC_FN(goalloc_malloc) c_malloc; /* my_malloc throws; C callers get NULL */
static GOALLOC_FN(my_free) c_free;
static GOALLOC_FN(goalloc_check_invariants) check_invariants;
static GOALLOC_FN(goalloc_last_error) last_error;

#ifndef THREADS
#define THREADS 2
#endif
#define LIVE 256
#define ITERS 200000

/* Live blocks of all threads, for the overlap check. */
static struct { uintptr_t p; size_t n; } live[THREADS][LIVE];
static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static int failures;

static void fail(const char *what, uintptr_t p) {
	__sync_fetch_and_add(&failures, 1);
	fprintf(stderr, "harness: FAIL: %s (%#lx)\n", what, (unsigned long)p);
}

static uint64_t rng_next(uint64_t *s) {
	*s ^= *s << 13; *s ^= *s >> 7; *s ^= *s << 17;
	return *s;
}

static size_t draw_size(uint64_t *s) {
	uint64_t r = rng_next(s);
	switch (r % 4) {
	case 0: return 1 + (r >> 8) % 4096;
	case 1: return 1 + (r >> 8) % (64 << 10);
	case 2: return (64 << 10) + (r >> 8) % (4 << 20);
	default: return (size_t)1 << (20 + (r >> 8) % 5); /* exact sizes: cache hits */
	}
}

static void *worker(void *arg) {
	int t = (int)(intptr_t)arg;
	uint64_t seed = 0x9e3779b97f4a7c15ull * (t + 1);
	void *stream = (void *)(uintptr_t)(0x1000 * (t + 1)); /* one stream per thread */
	for (int i = 0; i < ITERS; i++) {
		int k = rng_next(&seed) % LIVE;
		pthread_mutex_lock(&live_mu);
		uintptr_t old = live[t][k].p;
		size_t oldn = live[t][k].n;
		live[t][k].p = 0;
		pthread_mutex_unlock(&live_mu);
		if (old) {
			c_free((void *)old, (ssize_t)oldn, 0, stream);
			continue;
		}
		size_t n = draw_size(&seed);
		uintptr_t p = (uintptr_t)c_malloc((ssize_t)n, 0, stream);
		if (p == 0) { fail("goalloc_malloc returned NULL", n); continue; }
		if (p % 512) fail("pointer not 512-byte aligned", p);
		pthread_mutex_lock(&live_mu);
		for (int u = 0; u < THREADS; u++)
			for (int j = 0; j < LIVE; j++) {
				uintptr_t q = live[u][j].p;
				if (q && p < q + live[u][j].n && q < p + n) {
					fail("overlapping live blocks", p);
					fprintf(stderr, "  new %#lx+%zu (thread %d) vs %#lx+%zu (thread %d slot %d)\n",
						(unsigned long)p, n, t, (unsigned long)q, live[u][j].n, u, j);
				}
			}
		live[t][k].p = p;
		live[t][k].n = n;
		pthread_mutex_unlock(&live_mu);
	}
	for (int k = 0; k < LIVE; k++) {
		/* Out of the shared table first: the other thread may still run. */
		pthread_mutex_lock(&live_mu);
		uintptr_t p = live[t][k].p;
		size_t n = live[t][k].n;
		live[t][k].p = 0;
		pthread_mutex_unlock(&live_mu);
		if (p) c_free((void *)p, (ssize_t)n, 0, stream);
	}
	return NULL;
}

/* Each thread's refusals are its own: goalloc_last_error on a thread reads
 * the message of that thread's last failed call, never another thread's,
 * and goalloc_last_error_kind its kind (goalloc.h's GOALLOC_ERROR_KINDS); a warning (a free with the wrong size,
 * done all the same) replaces neither. Six threads, each with its own
 * refusal. */
static GOALLOC_FN(goalloc_set_fraction) set_fraction;
static GOALLOC_FN(goalloc_configure) configure;
static GOALLOC_FN(goalloc_last_error_kind) last_error_kind;
static GOALLOC_FN(goalloc_stat) stat_one;
static GOALLOC_FN(goalloc_stat_scalars) stat_scalars;
static volatile int workers_done;
#define ERROR_ITERS 20000

struct refusal { const char *want; int kind; int error_kind; };
static const struct refusal refusals[] = {
	{"malloc of a negative size", 0, GOALLOC_ERROR_bad_argument},
	{"free of a NULL pointer", 1, GOALLOC_ERROR_bad_argument},
	{"device 99 does not exist", 2, GOALLOC_ERROR_bad_argument},
	{"memory fraction 2 is outside", 3, GOALLOC_ERROR_bad_argument},
	{"GOALLOC_CONF", 4, GOALLOC_ERROR_bad_config},
	{"configure after the first allocation", 5, GOALLOC_ERROR_too_late},
};
#define NREFUSALS (int)(sizeof refusals / sizeof refusals[0])
static int wrong_messages, wrong_kinds;

static void *refuser(void *arg) {
	const struct refusal *r = &refusals[(intptr_t)arg];
	void *stream = (void *)(uintptr_t)(0x7000 + 0x100 * r->kind);
	for (int i = 0; i < ERROR_ITERS; i++) {
		switch (r->kind) {
		case 0: if (c_malloc(-1, 0, stream)) fail("negative size gave a pointer", 0); break;
		case 1: c_free(NULL, 0, 0, stream); break;
		case 2: if (c_malloc(1, 99, stream)) fail("unknown device gave a pointer", 99); break;
		case 3: if (set_fraction(0, 2.0) != -1) fail("fraction 2 accepted", 2); break;
		case 4: if (configure("bogus:1") != -1) fail("bogus configuration accepted", 0); break;
		case 5: if (configure("fraction:0.9") != -1) fail("configuration after use accepted", 0); break;
		}
		if (i % 100 == 0) { /* a warning in between */
			void *p = c_malloc(1000, 0, stream);
			c_free(p, 999, 0, stream);
		}
		char *e = last_error();
		if (!e || !strstr(e, r->want)) {
			if (__sync_fetch_and_add(&wrong_messages, 1) < 3)
				fprintf(stderr, "harness: thread of \"%s\" read \"%s\"\n", r->want, e ? e : "(NULL)");
		}
		free(e); /* goalloc_string_free is free(3) */
		int k = last_error_kind();
		if (k != r->error_kind && __sync_fetch_and_add(&wrong_kinds, 1) < 3)
			fprintf(stderr, "harness: thread of \"%s\" read kind %d, not %d\n", r->want, k, r->error_kind);
	}
	return NULL;
}

/* fresh_kind is the kind a thread reads before any call of its own has
 * failed: none, whatever other threads did. */
static void *fresh_kind(void *arg) {
	*(int *)arg = last_error_kind();
	return NULL;
}

static void check_last_error_per_thread(void) {
	int fresh = -1;
	pthread_t ft;
	pthread_create(&ft, NULL, fresh_kind, &fresh);
	pthread_join(ft, NULL);
	if (fresh != GOALLOC_ERROR_none) fail("a fresh thread read an error kind", (uintptr_t)fresh);
	pthread_t th[NREFUSALS];
	for (int t = 0; t < NREFUSALS; t++) pthread_create(&th[t], NULL, refuser, (void *)(intptr_t)t);
	for (int t = 0; t < NREFUSALS; t++) pthread_join(th[t], NULL);
	if (wrong_messages) {
		fprintf(stderr, "harness: FAIL: %d of %d refusals read another thread's last error or a warning\n",
			wrong_messages, NREFUSALS * ERROR_ITERS);
		failures++;
	}
	if (wrong_kinds) {
		fprintf(stderr, "harness: FAIL: %d of %d refusals read another thread's error kind or a warning's\n",
			wrong_kinds, NREFUSALS * ERROR_ITERS);
		failures++;
	}
}

/* reader calls goalloc_stat while the workers allocate: it never waits for
 * them, and never gets an error. */
static void *reader(void *arg) {
	(void)arg;
	long reads = 0;
	while (!workers_done) {
		if (stat_one(0, reads++ & 3) < 0) fail("goalloc_stat failed during allocation", 0);
	}
	return NULL;
}

/* stat reads one integer key out of the stats JSON. */
static long long stat(const char *json, const char *key) {
	char pat[256];
	snprintf(pat, sizeof pat, "\"%s\":", key);
	const char *at = strstr(json, pat);
	return at ? atoll(at + strlen(pat)) : -999;
}

int main(int argc, char **argv) {
	void *lib = open_library(argc, argv);
	c_malloc = GOALLOC_SYMBOL(lib, goalloc_malloc);
	c_free = GOALLOC_SYMBOL(lib, my_free);
	GOALLOC_FN(goalloc_init) init = GOALLOC_SYMBOL(lib, goalloc_init);
	check_invariants = GOALLOC_SYMBOL(lib, goalloc_check_invariants);
	last_error = GOALLOC_SYMBOL(lib, goalloc_last_error);
	GOALLOC_FN(goalloc_record_stream) record = GOALLOC_SYMBOL(lib, goalloc_record_stream);
	GOALLOC_FN(goalloc_stats_json) stats = GOALLOC_SYMBOL(lib, goalloc_stats_json);
	GOALLOC_FN(goalloc_string_free) strfree = GOALLOC_SYMBOL(lib, goalloc_string_free);
	GOALLOC_FN(goalloc_empty_cache) empty = GOALLOC_SYMBOL(lib, goalloc_empty_cache);
	set_fraction = GOALLOC_SYMBOL(lib, goalloc_set_fraction);
	stat_one = GOALLOC_SYMBOL(lib, goalloc_stat);
	stat_scalars = GOALLOC_SYMBOL(lib, goalloc_stat_scalars);
	configure = GOALLOC_SYMBOL(lib, goalloc_configure);
	last_error_kind = GOALLOC_SYMBOL(lib, goalloc_last_error_kind);
	if (!set_fraction || !last_error || !check_invariants || !c_malloc || !c_free || !init || !record || !stats || !strfree || !empty ||
	    !stat_one || !stat_scalars || !configure || !last_error_kind) {
		fprintf(stderr, "harness: missing symbol\n");
		return 1;
	}
	init(1);

	/* Bad input: clear errors, no crash, nothing lost. Its warnings are
	   queued (goalloc_warnings_capture) and checked below, not printed. */
	GOALLOC_FN(goalloc_warnings_capture) capture = GOALLOC_SYMBOL(lib, goalloc_warnings_capture);
	GOALLOC_FN(goalloc_warnings_take) take = GOALLOC_SYMBOL(lib, goalloc_warnings_take);
	if (!capture || !take) { fprintf(stderr, "harness: missing warning symbols\n"); return 1; }
	capture(1);
	if (c_malloc(-1, 0, NULL)) fail("negative size gave a pointer", 0);
	if (c_malloc(1, 99, NULL)) fail("unknown device gave a pointer", 99);
	stderr_to_file(); /* the refusal prints its out-of-memory line, as PyTorch's would */
	void *absurd = c_malloc((ssize_t)1 << 62, 0, NULL);
	if (stderr_back("goalloc: CUDA out of memory. Tried to allocate more than 1EB memory.") != 1)
		fail("no out-of-memory line for an absurd size", 0);
	if (absurd) fail("absurd size gave a pointer", 0);
	c_free(NULL, 0, 0, NULL);
	c_free((void *)0x1234, 512, 0, NULL);
	void *z = c_malloc(0, 0, NULL);
	if (!z) fail("size 0 gave NULL", 0);
	c_free(z, 0, 0, NULL);
	c_free(z, 0, 0, NULL); /* double free: warned and ignored */
	record((void *)0x1234, (void *)0x1000);
	char *warned = take();
	const char *kinds[] = {"negative_size", "bad_device", "null_pointer", "unknown_pointer", "double_free"};
	for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
		char pat[64];
		snprintf(pat, sizeof pat, "\"kind\":\"%s\"", kinds[i]);
		if (!warned || !strstr(warned, pat)) fail(kinds[i], 0);
	}
	if (take()) fail("the warning queue is not empty after it was taken", 0);
	strfree(warned);
	/* The per-thread check provokes a wrong-size free and a bad fraction:
	   their warnings are expected, so they stay queued and are dropped. */
	check_last_error_per_thread();
	char *expected = take();
	if (!expected || !strstr(expected, "\"kind\":\"size_mismatch\"")) fail("no size_mismatch warning", 0);
	strfree(expected);
	capture(0);

	pthread_t th[THREADS], rd;
	for (int t = 0; t < THREADS; t++) pthread_create(&th[t], NULL, worker, (void *)(intptr_t)t);
	pthread_create(&rd, NULL, reader, NULL);
	for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
	workers_done = 1;
	pthread_join(rd, NULL);

	char *js = stats(0);
	if (!js) { fail("stats JSON is NULL", 0); return 1; }
	long long allocated = stat(js, "allocated_bytes.all.current");
	long long count = stat(js, "allocation.all.current");
	long long dbl = stat(js, "goalloc.bad_input.double_free");
	long long neg = stat(js, "goalloc.bad_input.negative_size");
	long long hits = stat(js, "goalloc.cache_hits");
	if (allocated != 0 || count != 0) fail("memory still allocated after every free", (uintptr_t)allocated);
	if (dbl != 1) fail("double free not counted once", (uintptr_t)dbl);
	if (neg != 1 + ERROR_ITERS) fail("negative size not counted once per call", (uintptr_t)neg);
	/* The per-step figures, in goalloc_stat's documented order, equal the JSON's. */
	static const char *keys[] = {"allocated_bytes.all.current", "allocated_bytes.all.peak",
	                             "reserved_bytes.all.current", "reserved_bytes.all.peak"};
	int64_t fig[4];
	if (stat_scalars(0, fig, 4) != 4 || stat_scalars(0, NULL, 0) != 4) fail("goalloc_stat_scalars count", 0);
	for (int k = 0; k < 4; k++) {
		long long want = stat(js, keys[k]);
		if (stat_one(0, k) != want || fig[k] != want) fail(keys[k], (uintptr_t)stat_one(0, k));
	}
	capture(1); /* a bad key warns: queued and checked, not printed */
	if (stat_one(0, 4) != -1 || stat_one(99, 0) != -1) fail("goalloc_stat accepted a bad key or device", 0);
	char *bad_key = take();
	if (!bad_key || !strstr(bad_key, "\"kind\":\"invalid_argument\"")) fail("no warning of a bad statistic", 0);
	strfree(bad_key);
	capture(0);
	empty();
	char *js2 = stats(0);
	long long reserved = stat(js2, "reserved_bytes.all.current");
	if (reserved != 0) fail("reserved after empty_cache", (uintptr_t)reserved);
	if (check_invariants(0)) fail(last_error(), 0);
	printf("harness: %d threads x %d ops, cache hits %lld, %d failures\n", THREADS, ITERS, hits, failures);
	strfree(js);
	strfree(js2);
	return failures ? 1 : 0;
}
