package main

/*
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

// The last error of each OS thread, its kind (errkind.go) and its message:
// C callers and Python threads are OS threads, and each reads its own with
// goalloc_last_error_kind and goalloc_last_error. Go code sets it while an
// exported function runs, and an exported function runs on the thread of
// its C caller (a cgo callback keeps its goroutine on that thread until it
// returns), so setting it from Go sets the caller's. Kind and message are
// one allocation, set together, so that a reader never sees the kind of
// one failure with the message of another. The destructor frees a thread's
// error when the thread exits.
struct goalloc_thread_error {
	int kind;
	char msg[];
};

static pthread_key_t goalloc_error_key;
static pthread_once_t goalloc_error_once = PTHREAD_ONCE_INIT;

static void goalloc_error_make_key(void) { pthread_key_create(&goalloc_error_key, free); }

static struct goalloc_thread_error *goalloc_thread_error(void) {
	pthread_once(&goalloc_error_once, goalloc_error_make_key);
	return pthread_getspecific(goalloc_error_key);
}

// goalloc_set_thread_error sets the calling thread's last error; it takes
// ownership of msg, a malloc'd string. Out of host memory, the thread is
// left with no error (kind 0, message "") rather than a stale one.
static void goalloc_set_thread_error(int kind, char *msg) {
	size_t n = strlen(msg) + 1;
	struct goalloc_thread_error *e = malloc(sizeof *e + n);
	if (e != NULL) {
		e->kind = kind;
		memcpy(e->msg, msg, n);
	}
	free(msg);
	free(goalloc_thread_error());
	pthread_setspecific(goalloc_error_key, e);
}

// goalloc_thread_error_copy is a malloc'd copy of the calling thread's
// last error message, "" if it has none.
static char *goalloc_thread_error_copy(void) {
	struct goalloc_thread_error *e = goalloc_thread_error();
	return strdup(e != NULL ? e->msg : "");
}

// goalloc_thread_error_kind is the kind of the calling thread's last
// error, 0 if it has none.
static int goalloc_thread_error_kind(void) {
	struct goalloc_thread_error *e = goalloc_thread_error();
	return e != NULL ? e->kind : 0;
}
*/
import "C"

// setThreadError is the C ABI library's setLastError: the calling OS
// thread's last error becomes kind and msg.
func setThreadError(kind errorKind, msg string) {
	C.goalloc_set_thread_error(C.int(kind), C.CString(msg))
}

// threadError is a malloc'd copy of the calling thread's last error.
func threadError() *C.char { return C.goalloc_thread_error_copy() }

// threadErrorKind is the kind of the calling thread's last error.
func threadErrorKind() errorKind { return errorKind(C.goalloc_thread_error_kind()) }
