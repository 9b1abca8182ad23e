#include "launch/gpu_devices.h"

#include <fcntl.h>
#include <linux/bpf.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace deepnex::launch {
namespace {

bpf_insn Insn(uint8_t code, uint8_t dst, uint8_t src, int16_t off, int32_t imm) {
  bpf_insn i{};
  i.code = code;
  i.dst_reg = dst;
  i.src_reg = src;
  i.off = off;
  i.imm = imm;
  return i;
}

// The program over struct bpf_cgroup_dev_ctx {u32 access_type (access << 16
// | type); u32 major; u32 minor;} in r1; returns 1 to allow, 0 to refuse:
//
//   if type != char || major != 195 || minor >= 254: allow
//   if minor is one of granted: allow
//   refuse
std::vector<bpf_insn> Program(const std::vector<int>& granted) {
  std::vector<bpf_insn> p;
  std::vector<size_t> to_allow;  // jumps whose offset lands on "allow"
  auto jump_to_allow = [&](uint8_t op, int32_t imm) {
    to_allow.push_back(p.size());
    p.push_back(Insn(BPF_JMP | op | BPF_K, BPF_REG_2, 0, 0, imm));
  };
  p.push_back(Insn(BPF_LDX | BPF_W | BPF_MEM, BPF_REG_2, BPF_REG_1, 0, 0));
  p.push_back(Insn(BPF_ALU | BPF_AND | BPF_K, BPF_REG_2, 0, 0, 0xFFFF));
  jump_to_allow(BPF_JNE, BPF_DEVCG_DEV_CHAR);
  p.push_back(Insn(BPF_LDX | BPF_W | BPF_MEM, BPF_REG_2, BPF_REG_1, 4, 0));
  jump_to_allow(BPF_JNE, kNvidiaMajor);
  p.push_back(Insn(BPF_LDX | BPF_W | BPF_MEM, BPF_REG_2, BPF_REG_1, 8, 0));
  jump_to_allow(BPF_JGE, kNvidiaFirstControlMinor);
  for (int minor : granted) jump_to_allow(BPF_JEQ, minor);
  p.push_back(Insn(BPF_ALU64 | BPF_MOV | BPF_K, BPF_REG_0, 0, 0, 0));
  p.push_back(Insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0));
  const size_t allow = p.size();
  p.push_back(Insn(BPF_ALU64 | BPF_MOV | BPF_K, BPF_REG_0, 0, 0, 1));
  p.push_back(Insn(BPF_JMP | BPF_EXIT, 0, 0, 0, 0));
  for (size_t at : to_allow) p[at].off = static_cast<int16_t>(allow - at - 1);
  return p;
}

int Bpf(int cmd, bpf_attr* attr) {
  return static_cast<int>(syscall(__NR_bpf, cmd, attr, sizeof(*attr)));
}

absl::Status Refused(const std::string& what, const std::string& dir, int err) {
  return absl::FailedPreconditionError(absl::StrCat(
      "restricting GPU device nodes on cgroup v2 (", dir, "): ", what, ": ", strerror(err)));
}

}  // namespace

std::vector<std::string> GpuDenyRules(const std::vector<int>& granted) {
  std::vector<std::string> rules;
  for (int minor = 0; minor < kNvidiaFirstControlMinor; ++minor) {
    if (std::find(granted.begin(), granted.end(), minor) != granted.end()) continue;
    rules.push_back(absl::StrCat("c ", kNvidiaMajor, ":", minor, " rwm"));
  }
  return rules;
}

absl::Status AttachGpuDeviceProgram(const std::string& dir, const std::vector<int>& granted) {
  const std::vector<bpf_insn> program = Program(granted);
  static const char kLicense[] = "Apache-2.0";
  bpf_attr load{};
  load.prog_type = BPF_PROG_TYPE_CGROUP_DEVICE;
  load.insns = reinterpret_cast<uint64_t>(program.data());
  load.insn_cnt = static_cast<uint32_t>(program.size());
  load.license = reinterpret_cast<uint64_t>(kLicense);
  const int prog = Bpf(BPF_PROG_LOAD, &load);
  if (prog < 0) {
    const int err = errno;
    // Again with the verifier's log, for its reasons (a log from the first
    // load could itself fail it when the buffer fills).
    char log[4096] = "";
    load.log_buf = reinterpret_cast<uint64_t>(log);
    load.log_size = sizeof(log);
    load.log_level = 1;
    const int again = Bpf(BPF_PROG_LOAD, &load);
    if (again >= 0) close(again);
    return Refused(absl::StrCat("loading the device program (bpf)", *log ? ": " : "", log), dir,
                   err);
  }
  const int cgroup = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (cgroup < 0) {
    const int err = errno;
    close(prog);
    return Refused("opening the cgroup", dir, err);
  }
  bpf_attr attach{};
  attach.target_fd = static_cast<uint32_t>(cgroup);
  attach.attach_bpf_fd = static_cast<uint32_t>(prog);
  attach.attach_type = BPF_CGROUP_DEVICE;
  attach.attach_flags = BPF_F_ALLOW_MULTI;
  const int attached = Bpf(BPF_PROG_ATTACH, &attach);
  const int err = errno;
  // The cgroup holds the attached program; neither descriptor is needed.
  close(cgroup);
  close(prog);
  if (attached != 0) return Refused("attaching the device program", dir, err);
  return absl::OkStatus();
}

}  // namespace deepnex::launch
