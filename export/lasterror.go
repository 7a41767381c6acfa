package main

/*
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

// The last error of each OS thread: C callers and Python threads are OS
// threads, and each reads its own message with goalloc_last_error. Go code
// sets it while an exported function runs, and an exported function runs
// on the thread of its C caller (a cgo callback keeps its goroutine on that
// thread until it returns), so setting it from Go sets the caller's. The
// destructor frees a thread's message when the thread exits.
static pthread_key_t goalloc_error_key;
static pthread_once_t goalloc_error_once = PTHREAD_ONCE_INIT;

static void goalloc_error_make_key(void) { pthread_key_create(&goalloc_error_key, free); }

// goalloc_set_thread_error takes ownership of msg, a malloc'd string.
static void goalloc_set_thread_error(char *msg) {
	pthread_once(&goalloc_error_once, goalloc_error_make_key);
	free(pthread_getspecific(goalloc_error_key));
	pthread_setspecific(goalloc_error_key, msg);
}

// goalloc_thread_error_copy is a malloc'd copy of the calling thread's
// last error, "" if it has none.
static char *goalloc_thread_error_copy(void) {
	pthread_once(&goalloc_error_once, goalloc_error_make_key);
	const char *msg = pthread_getspecific(goalloc_error_key);
	return strdup(msg != NULL ? msg : "");
}
*/
import "C"

// setThreadError is the C ABI library's setLastError: the calling OS
// thread's last error becomes msg.
func setThreadError(msg string) { C.goalloc_set_thread_error(C.CString(msg)) }

// threadError is a malloc'd copy of the calling thread's last error.
func threadError() *C.char { return C.goalloc_thread_error_copy() }
