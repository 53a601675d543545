// The message of a library's last refused launch. MindSpore launches on its own threads and the
// caller reads the message from another, so it is written under a lock and read as a copy.
#pragma once
#include <cstdio>
#include <mutex>
#include <string>

namespace rfa {

class LastError {
 public:
  explicit LastError(const char *tag) : tag_(tag) {}

  // Records `message`, prints it on stderr under the library's tag, and returns 1 (a launch's
  // failure status).
  int Fail(const std::string &message) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      message_ = message;
    }
    std::fprintf(stderr, "[%s] error: %s\n", tag_, message.c_str());
    return 1;
  }

  // The message, copied under the lock into this thread's own string: a failure on another thread
  // cannot free the characters the caller is reading.
  const char *Read() {
    thread_local std::string copy;
    std::lock_guard<std::mutex> lock(mutex_);
    copy = message_;
    return copy.c_str();
  }

 private:
  const char *tag_;
  std::mutex mutex_;
  std::string message_;
};

}  // namespace rfa
