// What deepnex's daemons share: flag parsing with one-line errors (exit 2)
// and a main loop that stops the server on SIGINT or SIGTERM.
#ifndef DEEPNEX_TOOLS_DAEMON_H_
#define DEEPNEX_TOOLS_DAEMON_H_

#include <signal.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>

#include "deepnex/status.h"
#include "deepnex/units.h"

namespace deepnex::tools {

// Walks argv as "--flag value" or "--flag=value":
//
//   Flags flags("deepnex-ps", kUsage, argc, argv);
//   while (flags.Next()) {
//     if (flags.Is("--listen")) options.address = flags.Value();
//     else flags.Unknown();
//   }
//
// --help prints `usage` and exits 0; a bad flag or value prints one line
// naming it and exits 2.
class Flags {
 public:
  Flags(const char* program, const char* usage, int argc, char** argv)
      : program_(program), usage_(usage), argc_(argc), argv_(argv) {}

  bool Next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    has_value_ = false;
    if (flag_ == "--help" || flag_ == "-h") {
      std::cout << usage_;
      std::exit(0);
    }
    auto eq = flag_.find('=');
    if (flag_.rfind("--", 0) == 0 && eq != std::string::npos) {
      value_ = flag_.substr(eq + 1);
      flag_ = flag_.substr(0, eq);
      has_value_ = true;
    }
    return true;
  }

  bool Is(const char* name) const { return flag_ == name; }
  const std::string& flag() const { return flag_; }

  std::string Value() {
    if (has_value_) return value_;
    if (i_ + 1 >= argc_) Die(flag_ + " needs a value");
    return argv_[++i_];
  }

  double Number() {
    std::string text = Value();
    char* end = nullptr;
    double v = std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0') Die(flag_ + ": \"" + text + "\" is not a number");
    return v;
  }

  int Int() {
    std::string text = Value();
    char* end = nullptr;
    long v = std::strtol(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0') Die(flag_ + ": \"" + text + "\" is not an integer");
    // strtol's own overflow (ERANGE) is LONG_MIN or LONG_MAX, past these too.
    if (v < INT32_MIN || v > INT32_MAX) Die(flag_ + ": " + text + " is out of range");
    return static_cast<int>(v);
  }

  // Positive seconds, as milliseconds.
  std::chrono::milliseconds Seconds() {
    return OrDie(SecondsToMillis(Number(), flag_));
  }

  uint64_t Bytes() { return OrDie(ParseByteSize(Value(), flag_)); }

  template <typename T>
  T OrDie(absl::StatusOr<T> v) const {
    if (!v.ok()) Die(std::string(v.status().message()));
    return *std::move(v);
  }

  [[noreturn]] void Unknown() const { Die("unknown flag \"" + flag_ + "\""); }

  [[noreturn]] void Die(const std::string& message) const {
    std::cerr << program_ << ": " << message << " (see --help)\n";
    std::exit(2);
  }

 private:
  const char* program_;
  const char* usage_;
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string flag_, value_;
  bool has_value_ = false;
};

// A server's token when no flag gave one: $DEEPNEX_TOKEN, which unlike a
// flag other users cannot read in /proc.
inline void TokenFromEnvironment(std::string* token, const std::string& token_file) {
  const char* env = std::getenv("DEEPNEX_TOKEN");
  if (token->empty() && token_file.empty() && env != nullptr) *token = env;
}

// Blocks SIGINT and SIGTERM in every thread (construct it before any server
// starts threads), so that only Serve's waiter takes them. Ignores SIGPIPE:
// a peer that closed its end (a session's process that exited with its
// stdin unread, a socket) is an EPIPE for the one writer, never the end of
// the daemon and everyone's calls on it.
class SignalStop {
 public:
  SignalStop() {
    signal(SIGPIPE, SIG_IGN);
    sigemptyset(&signals_);
    sigaddset(&signals_, SIGINT);
    sigaddset(&signals_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
  }

  // Serves until a signal stops `server` (anything with Stop() and Wait()).
  template <typename Server>
  void Serve(Server& server) {
    std::thread waiter([&] {
      int sig = 0;
      sigwait(&signals_, &sig);
      server.Stop();
    });
    server.Wait();
    waiter.join();
  }

 private:
  sigset_t signals_;
};

}  // namespace deepnex::tools

#endif  // DEEPNEX_TOOLS_DAEMON_H_
