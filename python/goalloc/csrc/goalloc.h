/* goalloc.h: the C ABI of libgoalloc.so, declared once.
 *
 * Every function libgoalloc.so exports is declared here, and nowhere else
 * by hand: the Go functions behind them (export/) include this file, so
 * cgo's compiler refuses an //export whose C signature differs from its
 * declaration here; goalloc's C++ allocator class (goalloc_torch.cpp) takes
 * its function pointer types from it; the Python package's ctypes
 * declarations (python/goalloc/_lib.py) are checked against it by
 * tests/test_abi_header.py; and export/header_test.go checks that the
 * library exports exactly the functions declared here, with the signatures
 * cgo gives them. It lives beside the C++ class because the Python package
 * builds the class from its own copy of csrc/ (goalloc/_cxx.py), and reads
 * the statistics table at the end of this file for memory_summary().
 *
 * The header is C (C99) and C++; it needs no CUDA header. A CUDA stream is a
 * void* here (cudaStream_t is a pointer; NULL is the default stream), so
 * that a caller that includes cuda_runtime_api.h passes its cudaStream_t as
 * it is.
 *
 * Conventions.
 *
 *   - Control functions return 0 on success and -1 on error, or a string
 *     (usually JSON) that the caller frees with goalloc_string_free, NULL on
 *     error. Either way goalloc_last_error says what went wrong and
 *     goalloc_last_error_kind what kind of failure it was, for the calling
 *     OS thread.
 *   - NULL. A pointer argument is one of two things, and each function's
 *     comment says which:
 *       - an optional out-parameter (int* oom, char** err, int* device):
 *         NULL means the caller does not want that answer, and nothing is
 *         written;
 *       - anything else (a string, a buffer, an address): NULL is refused
 *         before the call does anything, as bad input of kind null_pointer,
 *         -1 or NULL returned and goalloc_last_error naming the function and
 *         the argument.
 *     Device pointers and streams are values, not C memory: my_free and
 *     goalloc_record_stream refuse a NULL pointer as the same bad input;
 *     goalloc_free_ptr takes it as an empty tensor's deleter and frees
 *     nothing, as free(3) does (and goalloc_string_free a NULL string); a
 *     NULL stream is the default stream.
 *   - A device that does not exist is refused (kind bad_argument); one that
 *     exists and was not used yet reads as all zeros.
 *   - A pool id is PyTorch's MempoolId_t, std::pair<unsigned long long,
 *     unsigned long long>, as two arguments id0, id1; (0, 0) is the general
 *     cache.
 */
#ifndef GOALLOC_H
#define GOALLOC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* --- what PyTorch calls: torch.cuda.memory.CUDAPluggableAllocator -------- */

/* my_malloc is goalloc_malloc for PyTorch: where goalloc_malloc returns
 * NULL it throws a C++ exception with goalloc's message (torch does not
 * check the pointer a pluggable allocator returns; export/torch_malloc.cpp
 * says why). C callers use goalloc_malloc. */
void *my_malloc(ssize_t size, int device, void *stream);

/* goalloc_malloc allocates size bytes on device for stream: the address,
 * or NULL on failure, and goalloc_last_error says why. */
void *goalloc_malloc(ssize_t size, int device, void *stream);

/* my_free frees ptr (not NULL) on device, with the size and stream it was
 * allocated with (a size or stream that differs is counted as bad input,
 * and the block is freed all the same). */
void my_free(void *ptr, ssize_t size, int device, void *stream);

/* goalloc_init: torch's set_init_fn, with torch's device count (0: every
 * device). goalloc_init_checked is the same, -1 on error. */
void goalloc_init(int device_count);

/* goalloc_empty_cache gives the cached memory of every device back to the
 * driver: torch's set_reset_fn. */
void goalloc_empty_cache(void);

/* goalloc_set_memory_fraction caps device at fraction (in [0, 1]) of its
 * memory: torch's set_memory_fraction_fn. goalloc_set_fraction is the same
 * with a status. */
void goalloc_set_memory_fraction(double fraction, int device);

/* goalloc_record_stream marks ptr (not NULL) as used by stream too: its free
 * waits for the work queued on stream. torch's set_record_stream_fn. */
void goalloc_record_stream(void *ptr, void *stream);

/* CUDA graphs. torch calls these hooks as C++ functions of type
 * void(int, MempoolId_t[, std::function<bool(cudaStream_t)>]). On x86-64
 * (System V) a 16-byte trivially copyable pair of integers travels in two
 * integer registers, exactly as two unsigned long long arguments do, and a
 * std::function, which is not trivially copyable, is passed by a hidden
 * reference: one more pointer argument, filter. goalloc never calls the
 * filter: it asks the driver whether the allocating stream is being
 * captured instead (caching/graphs.go). tests/gpu/graphs_check.py checks on
 * the GPU that the pool ids arriving here are the ones torch reports. */

/* torch's set_begin_allocate_to_pool: allocations on device go to the pool
 * (id0, id1) until the matching end. */
void goalloc_begin_allocate_to_pool(int device, unsigned long long id0, unsigned long long id1,
                                    void *filter);
/* torch's set_end_allocate_to_pool_fn. */
void goalloc_end_allocate_to_pool(int device, unsigned long long id0, unsigned long long id1);
/* torch's set_release_pool: the pool's memory goes back once it is free. */
void goalloc_release_pool(int device, unsigned long long id0, unsigned long long id1);

/* --- control functions: the Python package ------------------------------- */

/* goalloc_configure replaces GOALLOC_CONF with conf, before the first
 * allocation; "" is the defaults. NULL is refused: taken as "" it would
 * drop the caps and settings of GOALLOC_CONF without a word. */
int goalloc_configure(const char *conf);

int goalloc_init_checked(int device_count);

/* goalloc_check_device is 0 if device exists, else -1 (bad argument, and
 * goalloc_last_error names the devices there are); a question, not counted
 * as bad input. */
int goalloc_check_device(int device);

/* goalloc_device_count initialises the library from the environment and
 * gives the number of devices, or -1. */
int goalloc_device_count(void);

/* memory_stats() of device as JSON, with torch's keys and goalloc's own. */
char *goalloc_stats_json(int device);
/* The cached free memory of device, and how scattered it is, as JSON. */
char *goalloc_fragmentation_json(int device);
/* The segments, blocks and history of device (-1: every device made so
 * far) as JSON: [{device, segments, device_traces}, ...]. */
char *goalloc_snapshot_json(int device);
/* The configuration in force and what the library runs on, as JSON. */
char *goalloc_config_json(void);

int goalloc_reset_peak_stats(int device);
int goalloc_reset_accumulated_stats(int device);
int goalloc_set_fraction(int device, double fraction);
/* goalloc_empty_cache_device is goalloc_empty_cache of one device. */
int goalloc_empty_cache_device(int device);
/* goalloc_record_history is goalloc_record_history_opts(max_entries, NULL, 1). */
int goalloc_record_history(int max_entries);
/* goalloc_check_invariants runs the allocator's full self-check on device
 * (slow: for tests and debugging). */
int goalloc_check_invariants(int device);

/* goalloc_last_error is the message of the last call that failed on the
 * calling OS thread ("" if none), a copy to free with goalloc_string_free. */
char *goalloc_last_error(void);

/* goalloc_last_error_kind is the kind of that failure, set together with
 * its message: its number in GOALLOC_ERROR_KINDS, below. */
int goalloc_last_error_kind(void);

/* goalloc_string_free frees a string the library handed out; NULL, as with
 * free(3), is nothing to free. */
void goalloc_string_free(char *s);

/* --- the per-step statistics --------------------------------------------- */

/* memory_allocated() and its family as single numbers, read without the
 * allocator's mutex and without JSON, for a training loop that asks every
 * step (caching/counters.go says how the figures are published). key
 * indexes the published figures, in this fixed order (new figures are only
 * ever appended):
 *
 *   0  allocated_bytes.all.current   torch.cuda.memory_allocated()
 *   1  allocated_bytes.all.peak      torch.cuda.max_memory_allocated()
 *   2  reserved_bytes.all.current    torch.cuda.memory_reserved()
 *   3  reserved_bytes.all.peak       torch.cuda.max_memory_reserved()
 *
 * goalloc_stat returns the figure, or -1 for a device or key that does not
 * exist. */
long long goalloc_stat(int device, int key);

/* goalloc_stat_scalars writes the first n figures (fewer if the library has
 * fewer) into out and returns how many figures the library has, or -1; so
 * goalloc_stat_scalars(d, NULL, 0) asks how many there are. out is NULL
 * only with n = 0. */
int goalloc_stat_scalars(int device, int64_t *out, int n);

/* goalloc_stat_keys_json lists the keys in order, as goalloc_stats_json
 * names them. */
char *goalloc_stat_keys_json(void);

/* --- goalloc's C++ allocator class for PyTorch (goalloc_torch.cpp) -------- */

/* The class implements c10's CUDAAllocator over these calls. It evaluates
 * PyTorch's pool filters itself and names the pool of each allocation
 * (caching/pools.go); a failed allocation hands back its message directly,
 * so that the class can throw it (as c10::OutOfMemoryError for an
 * out-of-memory) after the call has returned: a C++ exception must never
 * unwind through Go frames.
 *
 * The _ctx calls name the call with the class's context id (0: none), which
 * goalloc keeps in its history and gives back in the snapshot
 * (caching/history.go, "Context ids"); the class keeps what the ids stand
 * for (PyTorch's stack traces; goalloc_contexts.h). */

/* goalloc_pool_malloc is goalloc_pool_malloc_ctx with no context id, the
 * rounding left to goalloc. */
void *goalloc_pool_malloc(size_t size, int device, void *stream, unsigned long long id0,
                          unsigned long long id1, int *oom, char **err);

/* goalloc_pool_malloc_ctx allocates size bytes on device for stream from
 * the pool (id0, id1), of a request the caller rounded to a block of block
 * bytes (PyTorch's roundup_power2_divisions; 0: goalloc rounds it). On
 * failure it returns NULL, *oom is 1 for an out-of-memory (else untouched)
 * and *err the message, freed with goalloc_string_free; both are optional
 * out-parameters, and the calling thread's last error says the same. */
void *goalloc_pool_malloc_ctx(size_t size, size_t block, int device, void *stream, unsigned long long id0,
                              unsigned long long id1, unsigned long long ctx, int *oom, char **err);

/* goalloc_free_ptr frees ptr on whichever device holds it: 0, or -1. A NULL
 * ptr (an empty tensor's deleter) frees nothing. */
int goalloc_free_ptr(void *ptr);

/* goalloc_free_ptr_ctx is goalloc_free_ptr under the context id ctx. It
 * writes the device the block was on to *device (an optional
 * out-parameter; -1 for a NULL ptr and on failure), so that the caller can
 * file the id with that device's history. */
int goalloc_free_ptr_ctx(void *ptr, unsigned long long ctx, int *device);

/* goalloc_empty_cache_ctx is goalloc_empty_cache under the context id ctx:
 * 0, or -1 when a device failed. */
int goalloc_empty_cache_ctx(unsigned long long ctx);

/* goalloc_record_history_opts turns history recording on, keeping the last
 * max_entries entries, or off (0), on every device, present and future, as
 * torch's _record_memory_history does: skip_actions names the actions not
 * to record, comma-separated (NULL or "": none; an unknown name is
 * refused); clear drops what was recorded, which recording on again
 * otherwise keeps (turning it off always drops it). */
int goalloc_record_history_opts(int max_entries, const char *skip_actions, int clear);

/* goalloc_set_trace_labels sets the labels of device's history entries
 * from now on, torch's compile_context and user_metadata (NULL: empty); a
 * device not used yet gets them when it is. */
int goalloc_set_trace_labels(int device, const char *compile_context, const char *user_metadata);

/* goalloc_torch_device_stats writes device's GOALLOC_TORCH_STAT_FIGURES
 * figures (the table at the end of this file) into out, which must hold n
 * of them: n must be GOALLOC_TORCH_STAT_FIGURES, and out is not NULL. */
int goalloc_torch_device_stats(int device, long long *out, int n);

/* goalloc_largest_cached_block is the largest request device's cache could
 * serve without going to the driver (cudnn.benchmark asks), or -1. */
long long goalloc_largest_cached_block(int device);

/* goalloc_create_or_incref_pool adds a user of the pool (id0, id1), making
 * it if need be: 0, or -1. */
int goalloc_create_or_incref_pool(int device, unsigned long long id0, unsigned long long id1);

/* goalloc_pool_use_count is the number of users of the pool, 0 if it does
 * not exist, -1 for a device that does not. */
int goalloc_pool_use_count(int device, unsigned long long id0, unsigned long long id1);

/* goalloc_pool_live_blocks lists the allocated blocks of a pool as JSON,
 * [[address, size, requested size, stream], ...] by address. */
char *goalloc_pool_live_blocks(int device, unsigned long long id0, unsigned long long id1);

/* goalloc_restore_pool sets a pool back to a checkpoint: blocks holds n
 * rows of goalloc_pool_live_blocks (4n numbers; NULL only when n is 0). It
 * returns JSON, {"freed": [addresses freed], "error": "" or what could not
 * be restored}, or NULL when the pool or device does not exist or the
 * arguments are refused. */
char *goalloc_restore_pool(int device, unsigned long long id0, unsigned long long id1,
                           const unsigned long long *blocks, int n);

/* goalloc_front_log is device's front log (caching/front.go), which the class's
 * front (goalloc_front.h) shares, made at the first call: Go memory pinned
 * for as long as the process runs. NULL when the configuration has no front
 * (front:false) or the device cannot be used. The class asks once per
 * device. */
void *goalloc_front_log(int device);

/* goalloc_front_drain applies what device's front log holds, for the class
 * when the log is full: 0, or -1 for a device that does not exist. A device
 * not used yet has nothing to drain. */
int goalloc_front_drain(int device);

/* goalloc_complete_recorded_free completes a free made during a capture
 * that waits for other streams, once the caller proved them done
 * (caching.CompleteRecordedFree): 1 if one was waiting, 0 if not, as for a
 * NULL ptr or a device goalloc holds nothing on. */
int goalloc_complete_recorded_free(int device, void *ptr);

/* Pools with an allocator of their own (torch.cuda.MemPool(allocator=...);
 * caching/external.go): the class carves them (goalloc_split.h); these
 * count what they hold, under the cap. A size beyond what the pools claimed
 * or hold is refused (invalid_size), so that neither the cap's count nor
 * the statistics wrap around. */

/* goalloc_external_claim claims size bytes under device's cap for a
 * segment an own-allocator pool is about to take: 0, or -1 with *err the
 * message (an optional out-parameter), which the calling thread's last
 * error says too. */
int goalloc_external_claim(int device, size_t size, char **err);

/* goalloc_external_unclaim gives back a claim whose segment was not made;
 * a refusal (a device goalloc holds nothing on, more than was claimed)
 * changes nothing and sets the calling thread's last error. */
void goalloc_external_unclaim(int device, size_t size);

/* goalloc_external_segment counts a segment at addr (not NULL) made
 * (alloc != 0) or freed: 0, or -1. */
int goalloc_external_segment(int device, int alloc, void *addr, size_t size, int large, void *stream);

/* goalloc_external_block counts a block at addr (not NULL) carved from a
 * segment, handed out (alloc != 0) or freed: 0, or -1. */
int goalloc_external_block(int device, int alloc, void *addr, size_t size, size_t requested, int large,
                           void *stream);

/* --- CUDA IPC (export/ipc.go) --------------------------------------------- */

/* Sharing blocks with other processes, on backend:vmm (else kind
 * bad_config): a block's physical handles as POSIX file descriptors of this
 * process, which a receiver duplicates with pidfd_getfd and maps in a range
 * of its own (Note [CUDA IPC] in arena/vmm_ipc.go). goalloc_ipc.h writes
 * and reads these fields as torch's expandable-segment handle. */

/* goalloc_ipc_export exports the live block at ptr (not NULL; looked up on
 * every device goalloc has made) and counts a share of it: its free waits
 * for goalloc_ipc_release of every share before the block is reused.
 * Writes the process id, the device, the bytes of each handle, the block's
 * offset from its first handle (optional out-parameters) and up to cap
 * descriptors into fds (not NULL), one per handle in address order. Returns
 * how many handles the block has; when more than cap, none is written and
 * no share counted (call again with room); -1 on failure. */
int goalloc_ipc_export(void *ptr, int *pid, int *device, unsigned long long *granule, unsigned long long *offset,
                       int *fds, int cap);

/* goalloc_ipc_release releases one share goalloc_ipc_export counted of the
 * block at ptr (not NULL): 0, or -1 where none is held. */
int goalloc_ipc_release(void *ptr);

/* goalloc_ipc_import maps on device the n (> 0) handles of granule bytes
 * that process pid exported as descriptors fds (not NULL), in a fresh range:
 * its base (the block is at base + its offset), or NULL: a process that
 * exited or a descriptor it no longer has, memory of another device, a
 * granule not a multiple of the device's allocation granularity (kind failed). */
void *goalloc_ipc_import(int device, int pid, unsigned long long granule, const int *fds, int n);

/* goalloc_ipc_close unmaps and releases an import by its base (not NULL):
 * 0, or -1. */
int goalloc_ipc_close(int device, void *base);

/* goalloc_record_stream_held is goalloc_record_stream for a pointer that
 * may not be goalloc's: torch's _share_cuda_ puts a shared storage's block
 * behind a DataPtr of its own (CudaIPCSentData), whose record_stream the
 * class would otherwise not recognise. 1: recorded; 0: goalloc holds no
 * block at ptr (NULL included), nothing done or said; -1 on failure. */
int goalloc_record_stream_held(void *ptr, void *stream);

/* --- memory tags, sleep and wake (export/sleep.go) ------------------------ */

/* Allocations carry a memory tag, so that the memory of a tag can be put to
 * sleep (its physical memory released, its addresses kept) and woken again
 * at the same addresses, as an RL trainer and inference engine sharing GPUs
 * need (caching/sleep.go, and Note [Sleep and wake] in arena/vmm_sleep.go).
 * Untagged memory is never touched by sleep. Tags are names: 1 to 64
 * printable ASCII characters, without spaces or commas; a list of tags is
 * comma-separated. Sleep and wake need backend:vmm (else kind bad_config);
 * a call the allocator's state refuses (sleep while anything is asleep or
 * during a CUDA graph capture, wake with nothing asleep, an allocation in a
 * tag asleep) is kind bad_state, and changes nothing. */

/* goalloc_set_memory_tag makes the calling OS thread's allocations carry
 * the tag name from now on, whichever way they arrive (PyTorch's pluggable
 * allocator, goalloc's C++ class, goalloc_malloc); NULL or "": untagged.
 * An allocation of a CUDA graph capture, or one that names a pool, is
 * never tagged. Once a tag is set, the C++ class's front stays off for
 * the process (caching/front.go). 0, or -1 for a bad name. */
int goalloc_set_memory_tag(const char *name);

/* goalloc_memory_tag is the calling thread's tag ("" when untagged), a
 * string to free with goalloc_string_free. */
char *goalloc_memory_tag(void);

/* goalloc_sleep puts every memory tag of device (-1: of every device
 * goalloc has made) to sleep: the live blocks of the tags in offload_tags
 * (NULL or "": none) are copied to pinned host memory, then the physical
 * memory of every tagged block and of the free cache is released, the
 * addresses kept. It waits for the work queued on the tags' memory to
 * complete, never for the whole device. It returns JSON,
 * {"offloaded_bytes", "released_bytes" (what the devices hold less),
 * "prepare_seconds" (pinning the host memory), "offload_seconds" (the
 * copies), "devices": [...]}, or NULL: a tag no thread ever set (bad_argument), a
 * device already asleep (bad_state), ... */
char *goalloc_sleep(int device, const char *offload_tags);

/* goalloc_wake_up maps the memory of the tags listed in tags (NULL: every
 * tag asleep) again on device (-1: every device where one of them is
 * asleep), at the same addresses, and copies back what was offloaded; the
 * others' contents are undefined. Each tag wakes whole or not at all, in
 * order. It returns JSON, {"mapped_bytes", "restored_bytes",
 * "map_seconds", "restore_seconds", "woken": [names], "devices": [...]},
 * or NULL: out of memory (kind out_of_memory)
 * leaves the tag that did not fit, and those after it, asleep, for another
 * call once memory is freed; nothing asleep there (bad_state). */
char *goalloc_wake_up(int device, const char *tags);

/* goalloc_prepare_sleep pins at least size bytes of host memory for the
 * offloads of device (-1: of every device goalloc has made; a device named
 * is made), now rather than at the first sleep, which then pins nothing if
 * it offloads no more. Allocations and frees go on while it pins, from
 * other threads. 0, or -1: size above 2^48 (bad_argument), backend:async
 * (bad_config), during a capture or while asleep (bad_state, failed). */
int goalloc_prepare_sleep(int device, unsigned long long size);

/* goalloc_sleep_state_json is device's memory tags as JSON: {"device",
 * "tags": {name: {"reserved_bytes", "asleep"}}, "asleep": [names],
 * "offloaded_bytes" (host copies kept), "host_area_bytes" (the pinned host
 * memory kept for them, reused by the next sleep)}. */
char *goalloc_sleep_state_json(int device);

/* --- Go's scheduler (export/sched.go says why) ---------------------------- */

/* goalloc_sched_yield yields the calling thread's goroutine to Go's
 * scheduler. Called by the class, never with a lock held. */
void goalloc_sched_yield(void);

/* goalloc_yield_every_ns is how often a thread should yield, in
 * nanoseconds (GOALLOC_CONF's yield_every; 0: never), or -1 while the
 * configuration has not been read yet (before the first allocation): ask
 * again later. */
long long goalloc_yield_every_ns(void);

/* --- warnings (export/warnings.go) ---------------------------------------- */

/* A function the library calls when a warning is queued. */
typedef void (*goalloc_notify_fn)(void);

/* goalloc_warnings_capture(1) queues warnings instead of printing them on
 * stderr; 0 prints them (the default). */
int goalloc_warnings_capture(int on);

/* goalloc_warnings_take hands the queue over as JSON, [{"kind", "message"},
 * ...], or NULL if it is empty; free it with goalloc_string_free. */
char *goalloc_warnings_take(void);

/* goalloc_warnings_notify registers fn, called (on a thread of the
 * library's own) when a warning is queued; NULL: none. It returns once a
 * call of the previous function in flight has returned, so that its caller
 * may then free it. */
int goalloc_warnings_notify(goalloc_notify_fn fn);

#ifdef __cplusplus
}
#endif

/* --- the error kinds ------------------------------------------------------
 *
 * What kind of failure a call met, so that a caller can choose its response
 * (the Python package, its exception type) without reading the message,
 * which is for people and may be reworded. A kind's number is its place in
 * this table: a kind keeps its number, and new kinds are appended.
 *
 *   none          no call of this thread has failed
 *   bad_argument  an argument the call refuses: a negative or absurd size,
 *                 a device that does not exist, a fraction outside [0, 1],
 *                 a pointer or pool goalloc does not hold, ...
 *   bad_config    a bad GOALLOC_CONF string (or goalloc_configure's), or a
 *                 bad GOALLOC_DEVICE, GOALLOC_SIM_DEVICES, GOALLOC_SIM_MEMORY
 *   out_of_memory the device, or the cap on it, has no room for the request
 *   failed        the driver or the device failed (no CUDA device, a device
 *                 that cannot be set up, a driver call that failed), or the
 *                 allocator found itself inconsistent
 *   too_late      a call that must come before the first allocation came
 *                 after it (goalloc_configure)
 *   bad_state     a call the allocator's state refuses now: sleep while
 *                 anything is asleep or during a CUDA graph capture,
 *                 wake_up with nothing asleep, an allocation in a memory
 *                 tag that is asleep; nothing changed
 *
 * Kinds bad_argument and bad_config are the caller's to fix (Python raises
 * ValueError); out_of_memory is OutOfMemoryError (a GoallocError, and a
 * torch.OutOfMemoryError where torch is loaded); the others GoallocError. Go's copy is
 * export/errkind.go's, which export/header_test.go holds to this one; the
 * Python package reads this table. */

/* X(name) */
#define GOALLOC_ERROR_KINDS(X) \
	X(none)                \
	X(bad_argument)        \
	X(bad_config)          \
	X(out_of_memory)       \
	X(failed)              \
	X(too_late)            \
	X(bad_state)

#define GOALLOC_ERROR_KIND_ENUM_(name) GOALLOC_ERROR_##name,
/* The kinds as C constants: GOALLOC_ERROR_none, GOALLOC_ERROR_bad_argument, ... */
enum goalloc_error_kind { GOALLOC_ERROR_KINDS(GOALLOC_ERROR_KIND_ENUM_) };

/* --- the statistics -------------------------------------------------------
 *
 * The figures of c10's DeviceStats, as goalloc_torch_device_stats writes
 * them: for each statistic of GOALLOC_STAT_ARRAYS, in order, its value for
 * each pool type of GOALLOC_STAT_POOLS, and for each of those its
 * GOALLOC_STAT_VALUES; then the counters of GOALLOC_STAT_COUNTERS. The
 * names are c10's field names and memory_stats()'s keys
 * (allocated_bytes.large_pool.peak, num_ooms). Arrays and counters are in
 * the order c10 declares them, pool types in c10's StatType order, values in
 * c10's Stat order. The order is part of the ABI: a C++ class built before
 * a change reads its figures by position.
 *
 * Each X(...) of GOALLOC_STAT_ARRAYS also gives its row in
 * torch.cuda.memory_summary()'s table and the row's label (the Python
 * package's memory_summary reads them from here); a statistic named
 * *_bytes is a size, the others are counts.
 *
 * Go's copy of these tables is caching/stats.go's, which
 * export/header_test.go holds to this one. */

/* X(name, summary row, summary label) */
#define GOALLOC_STAT_ARRAYS(X)                                  \
	X(allocation, 6, "Allocations")                         \
	X(segment, 8, "GPU reserved segments")                  \
	X(active, 7, "Active allocs")                           \
	X(inactive_split, 9, "Non-releasable allocs")           \
	X(allocated_bytes, 1, "Allocated memory")               \
	X(reserved_bytes, 4, "GPU reserved memory")             \
	X(active_bytes, 2, "Active memory")                     \
	X(inactive_split_bytes, 5, "Non-releasable memory")     \
	X(requested_bytes, 3, "Requested memory")

/* X(name) */
#define GOALLOC_STAT_POOLS(X) X(all) X(small_pool) X(large_pool)

/* X(name) */
#define GOALLOC_STAT_VALUES(X) X(current) X(peak) X(allocated) X(freed)

/* X(name) */
#define GOALLOC_STAT_COUNTERS(X)  \
	X(num_alloc_retries)      \
	X(num_ooms)               \
	X(num_sync_all_streams)   \
	X(num_device_alloc)       \
	X(num_device_free)

/* GOALLOC_STAT_COUNT(table) is how many entries a table has. */
#define GOALLOC_STAT_COUNT(table) (0 table(GOALLOC_STAT_ONE_))
#define GOALLOC_STAT_ONE_(...) +1

/* How many figures goalloc_torch_device_stats writes. */
#define GOALLOC_TORCH_STAT_FIGURES                                                  \
	(GOALLOC_STAT_COUNT(GOALLOC_STAT_ARRAYS) * GOALLOC_STAT_COUNT(GOALLOC_STAT_POOLS) * \
	     GOALLOC_STAT_COUNT(GOALLOC_STAT_VALUES) +                                  \
	 GOALLOC_STAT_COUNT(GOALLOC_STAT_COUNTERS))

#endif /* GOALLOC_H */
