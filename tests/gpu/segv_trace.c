// segv_trace.c: on SIGSEGV, write the native stack, the faulting address and
// the executable mappings to stderr, then let the handler installed before
// it (Go's runtime, then Python's faulthandler) take the signal. A check
// script loads it with ctypes where a crash's native stack is wanted and no
// debugger is at hand (tests/gpu/ipc_check.py with SEGV_TRACE=path).
//   gcc -shared -fPIC -O1 -o build/segv_trace.so tests/gpu/segv_trace.c
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <ucontext.h>
#include <unistd.h>

static struct sigaction previous;

static void copy_executable_maps(void) {
  char buf[1 << 16];
  int fd = open("/proc/self/maps", O_RDONLY);
  if (fd < 0) return;
  ssize_t n;
  char line[512];
  size_t len = 0;
  while ((n = read(fd, buf, sizeof buf)) > 0) {
    for (ssize_t i = 0; i < n; i++) {
      if (len < sizeof line - 1) line[len++] = buf[i];
      if (buf[i] == '\n') {
        line[len] = 0;
        if (strstr(line, " r-xp ") != NULL) (void)!write(2, line, len);
        len = 0;
      }
    }
  }
  close(fd);
}

static void on_segv(int sig, siginfo_t* si, void* ctx) {
  ucontext_t* uc = (ucontext_t*)ctx;
  dprintf(2, "segv_trace: signal %d, address %p, rip %#llx\n", sig, si->si_addr,
          (unsigned long long)uc->uc_mcontext.gregs[REG_RIP]);
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  dprintf(2, "segv_trace: executable mappings\n");
  copy_executable_maps();
  // Returning re-runs the faulting instruction under the previous handler.
  sigaction(SIGSEGV, &previous, NULL);
}

void segv_trace_install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &previous);
}
