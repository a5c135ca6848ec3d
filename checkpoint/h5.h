// RAII owners and checked calls for the HDF5 C API (serial, not thread-safe: see io_thread.h).
//
// Every call goes through T3D_H5, which throws t3d::UserError naming the call, the HDF5 file being
// worked on and HDF5's own innermost message. Errors are data problems (a damaged or missing
// file, a full disk) far more often than bugs, hence UserError.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "checkpoint/paths.h"

namespace t3d::checkpoint::h5 {

// Checks an HDF5 return value (negative = failure); `what` names the file or object in messages.
#define T3D_H5(call, what) ::t3d::checkpoint::h5::check((call), #call, (what), __FILE__, __LINE__)
int64_t check(int64_t ret, const char* call, const std::string& what, const char* file, int line);

// Turns off HDF5's own printing of error stacks (we report them ourselves). Idempotent.
void silence_errors();

// Owns one hid_t and closes it with the matching H5*close.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer close) : id_(id), close_(close) {}
  ~Handle() { reset(); }
  Handle(Handle&& o) noexcept : id_(o.id_), close_(o.close_) { o.id_ = H5I_INVALID_HID; }
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      id_ = o.id_, close_ = o.close_;
      o.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }
  // Closes now and reports a failure (H5Fclose flushes: a full disk shows up here).
  void close(const std::string& what);
  // Closes a file being written that is to be thrown away after a failure (a full disk): first
  // truncates it to free its space, so that the flush at close may succeed and HDF5 release the
  // file; if it still fails, the file's space is free at least. Never throws.
  void abandon_file(const std::string& path) noexcept;

 private:
  void reset() noexcept {
    if (id_ >= 0 && close_) close_(id_);
    id_ = H5I_INVALID_HID;
  }
  hid_t id_ = H5I_INVALID_HID;
  Closer close_ = nullptr;
};

// Files: created with the 1.10 format (checksummed metadata, virtual datasets). A created file
// refuses to close while any object in it is open (H5F_CLOSE_SEMI), so that the close, which
// flushes, is the one that reports a full disk instead of a later implicit one swallowing it.
// `configure`, if given, adds to the file access list (a file driver).
Handle create_file(const std::string& path, const std::function<void(hid_t fapl)>& configure = {});
Handle open_file(const std::string& path);  // read-only
// Read-only, the file behind `file`'s descriptor (not whatever its path names now).
Handle open_file(const ReadOnlyFile& file);
// A file only in memory (HDF5's core driver, nothing on disk); `name` for messages. file_image()
// returns its bytes once every object in it is closed, for the caller to write and check itself.
Handle create_memory_file(const std::string& name);
std::vector<char> file_image(hid_t file, const std::string& what);
// Opens (read-only) a file from its bytes, already read and verified by the caller: HDF5 parses
// exactly the bytes that were checked. `name` is the file's path, for messages.
Handle open_image(const std::string& name, const std::vector<char>& image);
Handle open_dataset(hid_t file, const std::string& path, const std::string& what);
// UserError unless every link on `path` from `loc` (each group on the way and the object itself)
// is a hard link: a soft or external link in a file read as data could lead anywhere, into
// another file included. Call before opening an object of a file that is not trusted.
void require_hard_links(hid_t loc, const std::string& path, const std::string& what);
Handle simple_space(const std::vector<int64_t>& dims);
// Link-creation property list that makes missing intermediate groups.
Handle intermediate_groups();

// Attributes on any object (file root, group, dataset).
void write_attr(hid_t obj, const std::string& name, const std::string& value);
void write_attr(hid_t obj, const std::string& name, int64_t value);
void write_attr(hid_t obj, const std::string& name, const std::vector<int64_t>& values);
void write_attr(hid_t obj, const std::string& name, const std::vector<uint64_t>& values);
bool has_attr(hid_t obj, const std::string& name);
std::string read_string_attr(hid_t obj, const std::string& name, const std::string& what);
int64_t read_int_attr(hid_t obj, const std::string& name, const std::string& what);
std::vector<int64_t> read_ints_attr(hid_t obj, const std::string& name, const std::string& what);
std::vector<uint64_t> read_uints_attr(hid_t obj, const std::string& name, const std::string& what);

}  // namespace t3d::checkpoint::h5
