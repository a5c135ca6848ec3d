// The HDF5 file driver shards are written through (h5_direct_driver.h).
#include "checkpoint/h5_direct_driver.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "checkpoint/direct_writer.h"
#include "checkpoint/h5.h"

namespace t3d::checkpoint {

namespace {

struct Driver {
  H5FD_t pub;          // first: HDF5 casts between the two
  int fd = -1;         // through the page cache
  int direct_fd = -1;  // O_DIRECT, or -1 where the file system refuses it
  haddr_t eoa = 0, eof = 0;
  uint64_t allocated = 0;         // the file's size after allocating its blocks up front, if it was
  bool allocation_tried = false;  // at the first raw write (allocate_ahead)
  dev_t dev = 0;
  ino_t ino = 0;
  ShardFileLog* log = nullptr;
  // Raw bytes gathered for one O_DIRECT write, in direct->buffer(): file range
  // [run_start, run_end) of a run of contiguous raw writes (write_raw); run_start is aligned.
  std::unique_ptr<DirectWriter> direct;
  bool run_open = false;
  uint64_t run_start = 0, run_end = 0;
};

struct Info {
  ShardFileLog* log;
};

herr_t fail(const char* func, hid_t minor, const char* what) {
  const int err = errno;
  H5Epush2(H5E_DEFAULT, __FILE__, func, __LINE__, H5E_ERR_CLS, H5E_VFL, minor,
           "%s failed: errno = %d, error message = '%s'", what, err, std::strerror(err));
  return -1;
}

H5FD_t* open_file(const char* name, unsigned flags, hid_t fapl, haddr_t maxaddr) {
  const auto* info = static_cast<const Info*>(H5Pget_driver_info(fapl));
  if (!info || !info->log || !(flags & H5F_ACC_RDWR)) {
    errno = EINVAL;
    fail("open_file", H5E_CANTOPENFILE, "shard driver (write only, with a log)");
    return nullptr;
  }
  int o = O_RDWR | O_CLOEXEC;
  if (flags & H5F_ACC_TRUNC) o |= O_TRUNC;
  if (flags & H5F_ACC_CREAT) o |= O_CREAT;
  if (flags & H5F_ACC_EXCL) o |= O_EXCL;
  const int fd = ::open(name, o, 0644);
  if (fd < 0) return fail("open_file", H5E_CANTOPENFILE, "open"), nullptr;
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    fail("open_file", H5E_CANTOPENFILE, "fstat");
    ::close(fd);
    return nullptr;
  }
  auto* d = new Driver{};
  d->fd = fd;
  d->direct_fd = ::open(name, O_WRONLY | O_CLOEXEC | O_DIRECT);  // -1: page cache only
  if (d->direct_fd >= 0) d->direct = std::make_unique<DirectWriter>(d->direct_fd);
  d->eof = static_cast<haddr_t>(st.st_size);
  d->dev = st.st_dev, d->ino = st.st_ino;
  d->log = info->log;
  (void)maxaddr;
  return &d->pub;
}

// Ends the run of raw writes being gathered (write_raw); with `wait`, also waits until every
// O_DIRECT write is done. False (errno set) when a write failed.
bool end_run(Driver* d, bool wait);

herr_t close_file(H5FD_t* file) {
  auto* d = reinterpret_cast<Driver*>(file);
  const bool ended = end_run(d, true);
  const int err = errno;
  d->direct.reset();
  int rc = ::close(d->fd);
  if (d->direct_fd >= 0 && ::close(d->direct_fd) != 0) rc = -1;
  if (!ended) errno = err;
  const herr_t ret = ended && rc == 0 ? 0 : fail("close_file", H5E_CLOSEERROR, "close");
  delete d;
  return ret;
}

int compare(const H5FD_t* a, const H5FD_t* b) {
  const auto* x = reinterpret_cast<const Driver*>(a);
  const auto* y = reinterpret_cast<const Driver*>(b);
  if (x->dev != y->dev) return x->dev < y->dev ? -1 : 1;
  if (x->ino != y->ino) return x->ino < y->ino ? -1 : 1;
  return 0;
}

herr_t query(const H5FD_t*, unsigned long* flags) {
  // No data sieving: contiguous raw data reaches write() straight from the caller's buffer.
  if (flags)
    *flags = H5FD_FEAT_AGGREGATE_METADATA | H5FD_FEAT_ACCUMULATE_METADATA |
             H5FD_FEAT_AGGREGATE_SMALLDATA;
  return 0;
}

haddr_t get_eoa(const H5FD_t* file, H5FD_mem_t) {
  return reinterpret_cast<const Driver*>(file)->eoa;
}
herr_t set_eoa(H5FD_t* file, H5FD_mem_t, haddr_t addr) {
  reinterpret_cast<Driver*>(file)->eoa = addr;
  return 0;
}
haddr_t get_eof(const H5FD_t* file, H5FD_mem_t) {
  return reinterpret_cast<const Driver*>(file)->eof;
}
herr_t get_handle(H5FD_t* file, hid_t, void** handle) {
  *handle = &reinterpret_cast<Driver*>(file)->fd;
  return 0;
}

herr_t read(H5FD_t* file, H5FD_mem_t, hid_t, haddr_t addr, size_t size, void* buf) {
  auto* d = reinterpret_cast<Driver*>(file);
  if (!end_run(d, true)) return fail("read", H5E_WRITEERROR, "file write");
  auto* p = static_cast<char*>(buf);
  while (size > 0) {
    const ssize_t n = ::pread(d->fd, p, size, static_cast<off_t>(addr));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail("read", H5E_READERROR, "file read");
    if (n == 0) {  // past the end of the file: zeros, as HDF5 expects
      std::memset(p, 0, size);
      break;
    }
    p += n, addr += static_cast<haddr_t>(n), size -= static_cast<size_t>(n);
  }
  return 0;
}

// Raw data goes through the DirectWriter's buffers, which gather contiguous raw writes (a box's
// rows, an incremental shard's chunks one after the other) into large O_DIRECT writes: a run starts
// at a 4 KiB-aligned offset (the bytes before it, through the page cache), is written whenever the
// buffer fills, and its last partial page goes through the page cache when the run ends (a raw
// write elsewhere, a read, a flush, the close). A page is thus only ever written one way, so the
// two paths never see each other's stale copies.
bool end_run(Driver* d, bool wait) {
  if (d->run_open) {
    d->run_open = false;
    const uint64_t held = d->run_end - d->run_start, aligned = held / kAlign * kAlign;
    d->log->direct_bytes += aligned;
    d->log->buffered_bytes += held - aligned;
    const char* b = d->direct->buffer();
    if (held > aligned && !write_all(d->fd, b + aligned, held - aligned, d->run_start + aligned))
      return false;
    if (aligned && !d->direct->submit(aligned, d->run_start)) return false;
  }
  return !wait || !d->direct || d->direct->wait();
}

// At the first raw write, at `addr`: allocates the blocks of the raw bytes to come (size_hint) from
// there, no more (HDF5's metadata before it stays a sparse hole where unused; what a deflated or
// incremental shard leaves unwritten is cut off by `truncate`). Where the file system cannot
// allocate ahead, writes extend the file as they go. Where the space is short (ENOSPC), whatever
// the file system allocated before giving up (ext4 keeps it) is released, and the rest of the file
// goes through the page cache, which takes blocks only as bytes are written: a shard that fits
// must not fail for want of the surplus. False (errno set) when a write failed.
bool allocate_ahead(Driver* d, haddr_t addr) {
  d->allocation_tried = true;
  const uint64_t ahead = d->log->size_hint;
  if (!ahead) return true;
  struct stat st {};
  if (::fstat(d->fd, &st) != 0) return false;
  if (::fallocate(d->fd, 0, static_cast<off_t>(addr), static_cast<off_t>(ahead)) == 0) {
    d->allocated = addr + ahead;
    return true;
  }
  if (errno != ENOSPC) return true;
  if (::ftruncate(d->fd, st.st_size) != 0 || !end_run(d, true)) return false;
  d->direct.reset();
  const int direct_fd = std::exchange(d->direct_fd, -1);
  return ::close(direct_fd) == 0;
}

bool write_raw(Driver* d, haddr_t addr, size_t size, const char* p) {
  if (d->direct && !d->allocation_tried && !allocate_ahead(d, addr)) return false;
  if (!d->direct) {
    d->log->buffered_bytes += size;
    return write_all(d->fd, p, size, addr);
  }
  if (d->run_open && addr != d->run_end && !end_run(d, false)) return false;
  if (!d->run_open) {
    const uint64_t head = std::min<uint64_t>(size, (kAlign - addr % kAlign) % kAlign);
    if (head && !write_all(d->fd, p, head, addr)) return false;
    d->log->buffered_bytes += head;
    p += head, addr += head, size -= head;
    if (!size) return true;
    d->run_open = true, d->run_start = d->run_end = addr;
  }
  while (size > 0) {
    char* b = d->direct->buffer();
    if (!b) return false;
    const size_t n = std::min<size_t>(size, kBounce - (d->run_end - d->run_start));
    std::memcpy(b + (d->run_end - d->run_start), p, n);
    d->run_end += n, p += n, size -= n;
    if (d->run_end - d->run_start == kBounce) {  // full: written, the run goes on after it
      if (!d->direct->submit(kBounce, d->run_start)) return false;
      d->log->direct_bytes += kBounce;
      d->run_start = d->run_end;
    }
  }
  return true;
}

herr_t write(H5FD_t* file, H5FD_mem_t type, hid_t, haddr_t addr, size_t size, const void* buf) {
  auto* d = reinterpret_cast<Driver*>(file);
  const auto* p = static_cast<const char*>(buf);
  bool ok;
  if (type == H5FD_MEM_DRAW) {
    d->log->digest.written(addr, p, size);
    ok = write_raw(d, addr, size, p);
  } else {
    d->log->digest.overwritten(addr, size);
    d->log->buffered_bytes += size;
    ok = write_all(d->fd, p, size, addr);
  }
  if (!ok) return fail("write", H5E_WRITEERROR, "file write");
  d->eof = std::max<haddr_t>(d->eof, addr + size);
  return 0;
}

herr_t flush(H5FD_t* file, hid_t, hbool_t) {
  return end_run(reinterpret_cast<Driver*>(file), true)
             ? 0
             : fail("flush", H5E_WRITEERROR, "file write");
}

herr_t truncate(H5FD_t* file, hid_t, hbool_t) {
  auto* d = reinterpret_cast<Driver*>(file);
  if (!end_run(d, true)) return fail("truncate", H5E_WRITEERROR, "file write");
  if (d->eoa == d->eof && d->allocated <= d->eoa) return 0;
  if (::ftruncate(d->fd, static_cast<off_t>(d->eoa)) != 0)
    return fail("truncate", H5E_SEEKERROR, "ftruncate");
  d->log->digest.overwritten(std::min(d->eoa, d->eof), d->eoa > d->eof ? d->eoa - d->eof : 0);
  d->eof = d->eoa, d->allocated = 0;
  return 0;
}

hid_t driver_id() {
  static const H5FD_class_t cls = [] {
    H5FD_class_t c{};
    c.name = "titan3d_shard";
    c.maxaddr = static_cast<haddr_t>((uint64_t{1} << 62) - 1);
    c.fc_degree = H5F_CLOSE_WEAK;
    c.fapl_size = sizeof(Info);
    c.open = open_file;
    c.close = close_file;
    c.cmp = compare;
    c.query = query;
    c.get_eoa = get_eoa;
    c.set_eoa = set_eoa;
    c.get_eof = get_eof;
    c.get_handle = get_handle;
    c.read = read;
    c.write = write;
    c.flush = flush;
    c.truncate = truncate;
    const H5FD_mem_t map[] = H5FD_FLMAP_DICHOTOMY;
    std::copy(std::begin(map), std::end(map), c.fl_map);
    return c;
  }();
  static const hid_t id = T3D_H5(H5FDregister(&cls), "the shard file driver");
  return id;
}

}  // namespace

void use_shard_driver(hid_t fapl, ShardFileLog* log) {
  const Info info{log};
  T3D_H5(H5Pset_driver(fapl, driver_id(), &info), "file access list");
  T3D_H5(H5Pset_meta_block_size(fapl, 1 << 20), "file access list");
}

}  // namespace t3d::checkpoint
