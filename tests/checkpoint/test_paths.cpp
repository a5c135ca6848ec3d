// ReadOnlyFile: the file checked is the file read (the descriptor, not the name), and a name that
// leads outside its directory is refused before anything outside is opened.
#include <gtest/gtest.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "checkpoint/h5.h"
#include "checkpoint/hash.h"
#include "checkpoint/paths.h"
#include "kernels/check.h"

namespace t3d::checkpoint {
namespace {

namespace fs = std::filesystem;

class Paths : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("t3d_paths_" + std::to_string(::getpid()));
    fs::remove_all(root_);
    inside_ = root_ / "inside";
    outside_ = root_ / "outside";
    fs::create_directories(inside_);
    fs::create_directories(outside_);
  }
  void TearDown() override { fs::remove_all(root_); }

  static void write(const fs::path& p, const std::string& text) {
    std::ofstream(p, std::ios::binary) << text;
  }

  fs::path root_, inside_, outside_;
};

std::string user_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

// Opens of `file` seen by inotify while `f` runs.
int opens_of(const fs::path& file, const std::function<void()>& f) {
  const int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_GE(inotify_add_watch(fd, file.c_str(), IN_OPEN | IN_ACCESS), 0);
  f();
  int events = 0;
  alignas(inotify_event) char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;)
    for (char* p = buf; p < buf + n;
         p += sizeof(inotify_event) + reinterpret_cast<inotify_event*>(p)->len)
      ++events;
  ::close(fd);
  return events;
}

TEST_F(Paths, TheFileReadIsTheFileCheckedWhateverLiesAtItsNameLater) {
  const fs::path a = inside_ / "a.bin", b = inside_ / "b.bin";
  write(a, "checked");
  write(b, "swapped in");
  const ReadOnlyFile f = ReadOnlyFile::open(a.string(), "test file");
  fs::rename(b, a);  // another file renamed over the checked one
  EXPECT_EQ(f.read_all(), "checked");
  fs::remove(a);
  ASSERT_EQ(mkfifo(a.c_str(), 0600), 0);  // a FIFO in its place would block a read by name
  EXPECT_EQ(f.read_all(), "checked");
  EXPECT_EQ(digest_file(f).bytes, 7u);
}

TEST_F(Paths, HdfFilesOpenThroughTheCheckedDescriptor) {
  const auto make = [](const fs::path& p, const std::string& tag) {
    const h5::Handle file = h5::create_file(p.string());
    h5::write_attr(file, "tag", tag);
  };
  const fs::path a = inside_ / "a.h5", b = inside_ / "b.h5";
  make(a, "checked");
  make(b, "other");
  {
    // The checked file moved aside, another put at its name: the checked one is read.
    const ReadOnlyFile f = ReadOnlyFile::open_inside(inside_.string(), "a.h5", "the test");
    fs::rename(a, inside_ / "aside.h5");
    fs::copy_file(b, a);
    const h5::Handle opened = h5::open_file(f);
    EXPECT_EQ(h5::read_string_attr(opened, "tag", f.path()), "checked");
  }
  // Another file renamed over the checked one (which is then deleted): refused, never the other.
  const ReadOnlyFile f = ReadOnlyFile::open_inside(inside_.string(), "a.h5", "the test");
  fs::rename(b, a);
  EXPECT_NE(user_error([&] { h5::open_file(f); }).find("was deleted or replaced"),
            std::string::npos);
}

TEST_F(Paths, SpecialFilesAreRefusedWithoutBlocking) {
  alarm(60);  // a blocking open of the FIFO would hang: the alarm makes that a failure
  const fs::path fifo = inside_ / "fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(user_error([&] { ReadOnlyFile::open(fifo.string(), "x"); }).find("a FIFO"),
            std::string::npos);
  EXPECT_NE(
      user_error([&] { ReadOnlyFile::open_inside(inside_.string(), "fifo", "x"); }).find("a FIFO"),
      std::string::npos);
  EXPECT_NE(user_error([&] { ReadOnlyFile::open("/dev/zero", "x"); }).find("a device"),
            std::string::npos);
  EXPECT_NE(user_error([&] { ReadOnlyFile::open(inside_.string(), "x"); }).find("a directory"),
            std::string::npos);
  alarm(0);
}

// Symbolic links out of the directory (to a file, through a directory, absolute or relative) are
// refused, and inotify sees no open of the target; links that stay inside are followed. Both ways
// of opening: openat2 (the kernel resolves beneath the directory) and the fallback for kernels
// without it (names checked before the open, the descriptor's path after it).
TEST_F(Paths, NamesLeadingOutsideAreRefusedBeforeAnythingOutsideIsOpened) {
  const fs::path secret = outside_ / "secret";
  write(secret, "outside");
  write(inside_ / "real", "inside");
  fs::create_symlink(secret, inside_ / "absolute");
  fs::create_symlink("../outside/secret", inside_ / "relative");
  fs::create_symlink(outside_, inside_ / "dir");
  fs::create_symlink("real", inside_ / "alias");
  using Open =
      std::function<ReadOnlyFile(const std::string&, const std::string&, const std::string&)>;
  const Open ways[] = {&ReadOnlyFile::open_inside, &ReadOnlyFile::open_inside_without_openat2};
  for (const Open& open : ways) {
    for (const std::string name : {"absolute", "relative", "dir/secret"}) {
      std::string error;
      EXPECT_EQ(
          opens_of(
              secret,
              [&] { error = user_error([&] { open(inside_.string(), name, "the test index"); }); }),
          0)
          << name;
      EXPECT_NE(error.find("leads outside"), std::string::npos) << name << ": " << error;
      EXPECT_NE(error.find("the test index"), std::string::npos) << error;
    }
    EXPECT_EQ(open(inside_.string(), "alias", "the test index").read_all(), "inside");
    EXPECT_NE(user_error([&] {
                open(inside_.string(), "../outside/secret", "the test index");
              }).find("not a plain relative path"),
              std::string::npos);
  }
  // The probe can fail: an open by name is seen.
  EXPECT_GT(opens_of(secret, [&] { ReadOnlyFile::open((inside_ / "absolute").string(), "x"); }), 0);
}

TEST_F(Paths, ShortReadsAndMissingFilesNameTheFile) {
  write(inside_ / "short", "abc");
  const ReadOnlyFile f = ReadOnlyFile::open((inside_ / "short").string(), "test file");
  char buf[8];
  EXPECT_NE(user_error([&] { f.read_at(1, buf, 8); }).find("short read from test file"),
            std::string::npos);
  EXPECT_NE(user_error([&] {
              ReadOnlyFile::open((inside_ / "none").string(), "test file");
            }).find("does not exist"),
            std::string::npos);
  EXPECT_NE(user_error([&] {
              ReadOnlyFile::open_inside(inside_.string(), "none", "the index");
            }).find("does not exist"),
            std::string::npos);
}

}  // namespace
}  // namespace t3d::checkpoint
