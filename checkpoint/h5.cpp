#include "checkpoint/h5.h"

#include <unistd.h>

#include "kernels/check.h"

namespace t3d::checkpoint::h5 {

namespace {

// The innermost (first-pushed) message of HDF5's current error stack: the most specific one.
std::string innermost_error() {
  std::string message;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_UPWARD,
      [](unsigned n, const H5E_error2_t* e, void* out) -> herr_t {
        if (n == 0 && e->desc) *static_cast<std::string*>(out) = e->desc;
        return 0;
      },
      &message);
  H5Eclear2(H5E_DEFAULT);
  return message.empty() ? "no detail from HDF5" : message;
}

}  // namespace

int64_t check(int64_t ret, const char* call, const std::string& what, const char* file, int line) {
  if (ret >= 0) return ret;
  throw UserError(detail::concat("HDF5 failed on `", what, "`: ", innermost_error(), " (", call,
                                 " at ", file, ":", line, ")"));
}

void silence_errors() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

void Handle::close(const std::string& what) {
  const hid_t id = id_;
  id_ = H5I_INVALID_HID;
  if (id >= 0 && close_) T3D_H5(close_(id), what);
}

namespace {
// HDF5 would otherwise close every file still registered at exit. A file whose close failed (a
// full disk) stays registered half-destroyed, and that exit-time close crashes the process
// (SIGSEGV after an orderly exit). Every file titan3d writes is closed, checked, before use, and
// read-only files need no flush, so nothing is lost by skipping it. Must precede any HDF5 call:
// a static initializer runs before main.
const bool kNoAtExit = [] {
  H5dont_atexit();
  return true;
}();
}  // namespace

void Handle::abandon_file(const std::string& path) noexcept {
  if (id_ < 0) return;
  if (::truncate(path.c_str(), 0) != 0) {
  }  // nothing more to free if it fails; the close below is still the best try
  const hid_t id = id_;
  id_ = H5I_INVALID_HID;
  if (H5Fflush(id, H5F_SCOPE_LOCAL) < 0) H5Eclear2(H5E_DEFAULT);
  if (H5Fclose(id) < 0) H5Eclear2(H5E_DEFAULT);
}

namespace {
Handle file_access() {
  Handle fapl(T3D_H5(H5Pcreate(H5P_FILE_ACCESS), "file access list"), H5Pclose);
  T3D_H5(H5Pset_libver_bounds(fapl, H5F_LIBVER_V110, H5F_LIBVER_V110), "file access list");
  return fapl;
}
}  // namespace

Handle create_file(const std::string& path, const std::function<void(hid_t fapl)>& configure) {
  silence_errors();
  const Handle fapl = file_access();
  T3D_H5(H5Pset_fclose_degree(fapl, H5F_CLOSE_SEMI), path);
  if (configure) configure(fapl);
  return {T3D_H5(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), path), H5Fclose};
}

Handle create_memory_file(const std::string& name) {
  silence_errors();
  const Handle fapl = file_access();
  T3D_H5(H5Pset_fclose_degree(fapl, H5F_CLOSE_SEMI), name);
  T3D_H5(H5Pset_fapl_core(fapl, 1 << 16, /*backing_store=*/0), name);
  // The oldest superblock that can hold virtual datasets: H5Fget_file_image of an open file with
  // a newer one (file status flags) does not read back.
  T3D_H5(H5Pset_libver_bounds(fapl, H5F_LIBVER_EARLIEST, H5F_LIBVER_V110), name);
  return {T3D_H5(H5Fcreate(name.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl), name), H5Fclose};
}

std::vector<char> file_image(hid_t file, const std::string& what) {
  T3D_H5(H5Fflush(file, H5F_SCOPE_GLOBAL), what);
  const ssize_t size = H5Fget_file_image(file, nullptr, 0);
  T3D_H5(size, what);
  std::vector<char> image(static_cast<size_t>(size));
  T3D_H5(H5Fget_file_image(file, image.data(), image.size()), what);
  return image;
}

Handle open_image(const std::string& name, const std::vector<char>& image) {
  silence_errors();
  const Handle fapl = file_access();
  T3D_H5(H5Pset_fapl_core(fapl, 1 << 16, /*backing_store=*/0), name);
  // HDF5 copies the image: it does not outlive this call's argument.
  T3D_H5(H5Pset_file_image(fapl, const_cast<char*>(image.data()), image.size()), name);
  // The core driver insists that no file of the name it opens an image under exists.
  const std::string image_name = name + " (verified image in memory)";
  return {T3D_H5(H5Fopen(image_name.c_str(), H5F_ACC_RDONLY, fapl), name), H5Fclose};
}

Handle open_file(const std::string& path) {
  silence_errors();
  const Handle fapl = file_access();
  return {T3D_H5(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), path), H5Fclose};
}

Handle open_file(const ReadOnlyFile& file) {
  silence_errors();
  const Handle fapl = file_access();
  // HDF5 resolves the descriptor's name to the file's real path, which a deleted file lacks.
  T3D_USER_CHECK(!file.deleted(), "`", file.path(),
                 "` was deleted or replaced while titan3d read it; run the command again once "
                 "nothing else writes that directory");
  return {T3D_H5(H5Fopen(file.descriptor_path().c_str(), H5F_ACC_RDONLY, fapl), file.path()),
          H5Fclose};
}

Handle open_dataset(hid_t file, const std::string& path, const std::string& what) {
  return {T3D_H5(H5Dopen2(file, path.c_str(), H5P_DEFAULT), what + ":" + path), H5Dclose};
}

void require_hard_links(hid_t loc, const std::string& path, const std::string& what) {
  for (size_t end = path.find('/', 1);; end = path.find('/', end + 1)) {
    const std::string prefix = path.substr(0, end);
    H5L_info_t info;
    T3D_H5(H5Lget_info(loc, prefix.c_str(), &info, H5P_DEFAULT), what + ":" + prefix);
    T3D_USER_CHECK(info.type == H5L_TYPE_HARD, "`", what, "`: `", prefix, "` is ",
                   info.type == H5L_TYPE_EXTERNAL ? "an external link (into another file)"
                                                  : "a soft or user-defined link",
                   "; titan3d reads only objects stored in the file itself. The file is not one "
                   "titan3d wrote: resume from another snapshot.");
    if (end == std::string::npos) return;
  }
}

Handle simple_space(const std::vector<int64_t>& dims) {
  std::vector<hsize_t> d(dims.begin(), dims.end());
  return {T3D_H5(H5Screate_simple(static_cast<int>(d.size()), d.data(), nullptr), "dataspace"),
          H5Sclose};
}

Handle intermediate_groups() {
  Handle lcpl(T3D_H5(H5Pcreate(H5P_LINK_CREATE), "link list"), H5Pclose);
  T3D_H5(H5Pset_create_intermediate_group(lcpl, 1), "link list");
  return lcpl;
}

namespace {
void write_attr_raw(hid_t obj, const std::string& name, hid_t file_type, hid_t mem_type,
                    const std::vector<int64_t>& dims, const void* data) {
  if (H5Aexists(obj, name.c_str()) > 0) T3D_H5(H5Adelete(obj, name.c_str()), name);
  const Handle space =
      dims.empty() ? Handle(T3D_H5(H5Screate(H5S_SCALAR), name), H5Sclose) : simple_space(dims);
  const Handle attr(
      T3D_H5(H5Acreate2(obj, name.c_str(), file_type, space, H5P_DEFAULT, H5P_DEFAULT), name),
      H5Aclose);
  T3D_H5(H5Awrite(attr, mem_type, data), name);
}

Handle string_type(size_t size) {
  Handle type(T3D_H5(H5Tcopy(H5T_C_S1), "string type"), H5Tclose);
  T3D_H5(H5Tset_size(type, std::max<size_t>(1, size)), "string type");
  T3D_H5(H5Tset_cset(type, H5T_CSET_UTF8), "string type");
  return type;
}

Handle open_attr(hid_t obj, const std::string& name, const std::string& what) {
  T3D_USER_CHECK(H5Aexists(obj, name.c_str()) > 0, "`", what, "` has no attribute `", name,
                 "`: not a titan3d snapshot, or written by an incompatible version");
  return {T3D_H5(H5Aopen(obj, name.c_str(), H5P_DEFAULT), what + "@" + name), H5Aclose};
}

int64_t attr_elements(hid_t attr, const std::string& what) {
  const Handle space(T3D_H5(H5Aget_space(attr), what), H5Sclose);
  return T3D_H5(H5Sget_simple_extent_npoints(space), what);
}
}  // namespace

// Fixed-length strings: h5py reads them as bytes, h5dump prints them verbatim.
void write_attr(hid_t obj, const std::string& name, const std::string& value) {
  const Handle type = string_type(value.size());
  write_attr_raw(obj, name, type, type, {}, value.data());
}
void write_attr(hid_t obj, const std::string& name, int64_t value) {
  write_attr_raw(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, {}, &value);
}
void write_attr(hid_t obj, const std::string& name, const std::vector<int64_t>& values) {
  write_attr_raw(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64,
                 {static_cast<int64_t>(std::max<size_t>(1, values.size()))},
                 values.empty() ? std::vector<int64_t>{0}.data() : values.data());
}
void write_attr(hid_t obj, const std::string& name, const std::vector<uint64_t>& values) {
  T3D_ASSERT(!values.empty(), "empty attribute ", name);
  write_attr_raw(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, {static_cast<int64_t>(values.size())},
                 values.data());
}

bool has_attr(hid_t obj, const std::string& name) { return H5Aexists(obj, name.c_str()) > 0; }

std::string read_string_attr(hid_t obj, const std::string& name, const std::string& what) {
  const Handle attr = open_attr(obj, name, what);
  const Handle type(T3D_H5(H5Aget_type(attr), what), H5Tclose);
  T3D_USER_CHECK(H5Tget_class(type) == H5T_STRING && H5Tis_variable_str(type) == 0, "`", what, "@",
                 name, "` is not a fixed-length string");
  std::string value(H5Tget_size(type), '\0');
  T3D_H5(H5Aread(attr, type, value.data()), what + "@" + name);
  while (!value.empty() && value.back() == '\0') value.pop_back();
  return value;
}

int64_t read_int_attr(hid_t obj, const std::string& name, const std::string& what) {
  const auto v = read_ints_attr(obj, name, what);
  T3D_USER_CHECK(v.size() == 1, "`", what, "@", name, "` should be one integer");
  return v[0];
}

std::vector<int64_t> read_ints_attr(hid_t obj, const std::string& name, const std::string& what) {
  const Handle attr = open_attr(obj, name, what);
  std::vector<int64_t> v(static_cast<size_t>(attr_elements(attr, what)));
  T3D_H5(H5Aread(attr, H5T_NATIVE_INT64, v.data()), what + "@" + name);
  return v;
}

std::vector<uint64_t> read_uints_attr(hid_t obj, const std::string& name, const std::string& what) {
  const Handle attr = open_attr(obj, name, what);
  std::vector<uint64_t> v(static_cast<size_t>(attr_elements(attr, what)));
  T3D_H5(H5Aread(attr, H5T_NATIVE_UINT64, v.data()), what + "@" + name);
  return v;
}

}  // namespace t3d::checkpoint::h5
