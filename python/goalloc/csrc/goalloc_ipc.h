// CUDA IPC handles as torch writes and reads them: goalloc's C++ class
// builds its shareIpcHandle string from goalloc_ipc_export's fields, and
// parses getIpcDevPtr's, here. The format is torch 2.11's
// (c10/cuda/CUDACachingAllocator.cpp), described in Note [CUDA IPC] in
// arena/vmm_ipc.go:
//
//   byte 0   the version, 2 (kVersion)
//   byte 1   the type: 'c' (a cudaIpcMemHandle_t of 64 bytes follows) or
//            'e' (an expandable segment's range follows)
//   'e'      a ShareHeader {int32 pid; 4 bytes of zeros; uint64
//            segment_size; uint64 num_handles} (24 bytes, native byte
//            order), then num_handles int32 descriptor numbers of process
//            pid, one per handle of segment_size bytes, in address order.
//   A string of exactly 64 bytes is an older torch's bare cudaIpcMemHandle_t.
//
// goalloc writes 'e' (its memory is VMM handles, which cudaIpcGetMemHandle
// cannot share), so a native receiver opens it; it reads both, so it opens
// a native sender's. The receiver adds the offset that travels beside the
// string. This header needs no torch and no CUDA: tests/c/ipc_test.cpp
// drives it against libgoalloc.so on the simulated device.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace goalloc_ipc {

constexpr char kVersion = 2;
constexpr char kTypeCudaMalloc = 'c';
constexpr char kTypeExpandable = 'e';
constexpr size_t kCudaIpcHandleSize = 64;  // CUDA_IPC_HANDLE_SIZE

// torch's ShareHeader, byte for byte on x86-64 and aarch64 Linux.
struct Header {
  int32_t pid;
  int32_t pad;  // zero, so that one range always gives the same string
  uint64_t segment_size;
  uint64_t num_handles;
};
static_assert(sizeof(Header) == 24, "torch's ShareHeader is 24 bytes");

// An expandable segment's range: what goalloc_ipc_export gives and
// goalloc_ipc_import takes.
struct Range {
  int32_t pid = 0;
  uint64_t segment_size = 0;
  std::vector<int32_t> fds;
};

// encode is the handle string of r, type 'e'.
inline std::string encode(const Range& r) {
  std::string s;
  s.push_back(kVersion);
  s.push_back(kTypeExpandable);
  Header h{};
  h.pid = r.pid;
  h.segment_size = r.segment_size;
  h.num_handles = r.fds.size();
  s.append(reinterpret_cast<const char*>(&h), sizeof h);
  s.append(reinterpret_cast<const char*>(r.fds.data()), r.fds.size() * sizeof(int32_t));
  return s;
}

// Parsed is a handle string read: its type, and for 'c' the 64 bytes of
// the cudaIpcMemHandle_t, for 'e' the range.
struct Parsed {
  char type = 0;
  std::string cuda_handle;
  Range range;
};

// parse reads a handle string; false with err set when it is not one
// torch 2.11 writes (a later version, an unknown type, a short string).
inline bool parse(const std::string& s, Parsed* out, std::string* err) {
  if (s.size() == kCudaIpcHandleSize) {
    out->type = kTypeCudaMalloc;
    out->cuda_handle = s;
    return true;
  }
  if (s.size() < 2) {
    *err = "a CUDA IPC handle of " + std::to_string(s.size()) + " bytes";
    return false;
  }
  if (s[0] > kVersion || s[0] < 1) {
    *err = "a CUDA IPC handle of version " + std::to_string(int(s[0])) + ", from a torch this goalloc does not know";
    return false;
  }
  out->type = s[1];
  if (out->type == kTypeCudaMalloc) {
    if (s.size() != 2 + kCudaIpcHandleSize) {
      *err = "a 'c' CUDA IPC handle of " + std::to_string(s.size()) + " bytes";
      return false;
    }
    out->cuda_handle = s.substr(2);
    return true;
  }
  if (out->type != kTypeExpandable) {
    *err = std::string("a CUDA IPC handle of unknown type '") + out->type + "'";
    return false;
  }
  Header h{};
  if (s.size() < 2 + sizeof h) {
    *err = "an expandable-segment CUDA IPC handle shorter than its header";
    return false;
  }
  std::memcpy(&h, s.data() + 2, sizeof h);
  size_t want = 2 + sizeof h + h.num_handles * sizeof(int32_t);
  if (h.num_handles == 0 || h.num_handles > (s.size() - 2 - sizeof h) / sizeof(int32_t) || s.size() != want) {
    *err = "an expandable-segment CUDA IPC handle whose " + std::to_string(h.num_handles) +
           " descriptors do not fit its " + std::to_string(s.size()) + " bytes (a fabric handle?)";
    return false;
  }
  out->range.pid = h.pid;
  out->range.segment_size = h.segment_size;
  out->range.fds.resize(h.num_handles);
  std::memcpy(out->range.fds.data(), s.data() + 2 + sizeof h, h.num_handles * sizeof(int32_t));
  return true;
}

}  // namespace goalloc_ipc
