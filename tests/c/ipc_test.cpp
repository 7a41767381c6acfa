// goalloc_ipc.h, the C++ class's writer and reader of torch's CUDA IPC
// handles, against libgoalloc.so on the simulated device (backend:vmm): a
// block's export written as torch's 'e' string and read back gives the
// same fields, byte for byte the layout torch 2.11 reads (header of 24
// bytes, zero padding, int32 descriptors); read back, it imports on the
// device and closes; a shared block's free waits for the release. The
// strings torch's reader refuses are refused here too.
//
//   c++ -std=c++17 -Ipython/goalloc/csrc tests/c/ipc_test.cpp -o build/ipc_test -ldl
//   GOALLOC_DEVICE=sim GOALLOC_SIM_MEMORY=8G build/ipc_test build/libgoalloc.so
#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "goalloc_ipc.h"
#include "open_library.h"
#include "expect.h"

int main(int argc, char** argv) {
  void* lib = open_library(argc, argv);
  auto init = GOALLOC_SYMBOL(lib, goalloc_init);
  auto cmalloc = GOALLOC_SYMBOL(lib, goalloc_malloc);
  auto cfree = GOALLOC_SYMBOL(lib, my_free);
  auto stat = GOALLOC_SYMBOL(lib, goalloc_stat);
  auto exp = GOALLOC_SYMBOL(lib, goalloc_ipc_export);
  auto rel = GOALLOC_SYMBOL(lib, goalloc_ipc_release);
  auto imp = GOALLOC_SYMBOL(lib, goalloc_ipc_import);
  auto cls = GOALLOC_SYMBOL(lib, goalloc_ipc_close);
  if (!init || !cmalloc || !cfree || !stat || !exp || !rel || !imp || !cls) {
    std::fprintf(stderr, "ipc_test: missing symbol\n");
    return 1;
  }
  init(1);
  const unsigned long long n = 40ull << 20;  // several handles (of 4 MiB, the default)
  void* p = cmalloc(static_cast<ssize_t>(n), 0, nullptr);
  EXPECT(p != nullptr, "malloc");

  int pid = 0, dev = -1;
  unsigned long long gran = 0, off = 0;
  int fds[16];
  int k = exp(p, &pid, &dev, &gran, &off, fds, 16);
  EXPECT(k >= 3 && pid == getpid() && dev == 0 && gran > 0, "export: %d handles, pid %d", k, pid);

  goalloc_ipc::Range r;
  r.pid = pid;
  r.segment_size = gran;
  r.fds.assign(fds, fds + (k > 0 ? k : 0));
  std::string s = goalloc_ipc::encode(r);
  EXPECT(s.size() == 2 + 24 + 4 * static_cast<size_t>(k), "length %zu", s.size());
  EXPECT(s[0] == 2 && s[1] == 'e', "version and type");
  int32_t pid_at;
  int32_t pad_at;
  unsigned long long seg_at, count_at;
  std::memcpy(&pid_at, s.data() + 2, 4);
  std::memcpy(&pad_at, s.data() + 6, 4);
  std::memcpy(&seg_at, s.data() + 10, 8);
  std::memcpy(&count_at, s.data() + 18, 8);
  EXPECT(pid_at == pid && pad_at == 0 && seg_at == gran && count_at == static_cast<unsigned long long>(k), "header");
  EXPECT(goalloc_ipc::encode(r) == s, "the same range, the same string (receivers cache by it)");

  goalloc_ipc::Parsed got;
  std::string err;
  EXPECT(goalloc_ipc::parse(s, &got, &err), "parse: %s", err.c_str());
  EXPECT(got.type == 'e' && got.range.pid == pid && got.range.segment_size == gran && got.range.fds == r.fds, "fields");

  void* base = imp(0, got.range.pid, got.range.segment_size, got.range.fds.data(), static_cast<int>(got.range.fds.size()));
  EXPECT(base != nullptr, "import");
  EXPECT(base != nullptr && cls(0, base) == 0, "close");

  // The free waits for the release.
  long long before = stat(0, 0);
  cfree(p, static_cast<ssize_t>(n), 0, nullptr);
  EXPECT(stat(0, 0) == before, "a shared block stays allocated after its free");
  EXPECT(rel(p) == 0, "release");
  EXPECT(stat(0, 0) < before, "freed at the release");

  // What torch's reader refuses.
  goalloc_ipc::Parsed bad;
  EXPECT(!goalloc_ipc::parse(std::string("\x03" "e", 2), &bad, &err), "a later version");
  EXPECT(!goalloc_ipc::parse(std::string("\x02" "x", 2), &bad, &err), "an unknown type");
  EXPECT(!goalloc_ipc::parse(s.substr(0, s.size() - 1), &bad, &err), "a short string");
  std::string fabric = s.substr(0, 26) + std::string(64 * static_cast<size_t>(k), '\0');
  EXPECT(!goalloc_ipc::parse(fabric, &bad, &err) && err.find("fabric") != std::string::npos, "fabric: %s", err.c_str());
  EXPECT(goalloc_ipc::parse(std::string(64, '\x01'), &bad, &err) && bad.type == 'c', "an older torch's bare handle");
  std::string c = std::string("\x02" "c", 2) + std::string(64, '\x07');
  EXPECT(goalloc_ipc::parse(c, &bad, &err) && bad.type == 'c' && bad.cuda_handle == std::string(64, '\x07'), "'c'");

  std::printf("ipc_test: %d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
