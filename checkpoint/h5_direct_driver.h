// The HDF5 file driver shards are written through. Raw data (tensor values, stored chunks) is
// gathered into 8 MiB buffers and goes to the device with O_DIRECT, into blocks allocated ahead,
// written in order by a helper thread while the next buffers fill: the kernel neither copies it
// into the page cache nor writes it back later, and the device streams while the caller hashes.
// HDF5's metadata and the unaligned edges of raw runs go through the page cache as usual. The
// helper (DirectWriter, direct_writer.h) makes no HDF5 call. Every raw byte is also handed to a
// FileDigestBuilder as it is written, so the shard's whole-file digest needs no second read of
// the file. The file is an ordinary HDF5 file: readers open it with HDF5's default driver.
//
// Where O_DIRECT is refused (a file system without it), everything goes through the page cache.
// Runs on the I/O thread, as every HDF5 call.
#pragma once

#include <hdf5.h>

#include <cstdint>

#include "checkpoint/hash.h"

namespace t3d::checkpoint {

// What one shard file's writes went through; the driver fills it while the file is open.
struct ShardFileLog {
  // Set before the file is created: the most raw bytes it will hold (0: unknown). The driver then
  // allocates that many blocks at the first raw write, since O_DIRECT writes that extend a file
  // are much slower than writes into allocated blocks (ext4: 390-400 against 550-740 MB/s of 8 MiB
  // writes on this project's machine), and trims what is left over when the file closes, before
  // the caller writes anything else. Where the space is short (ENOSPC) it allocates nothing ahead
  // and writes through the page cache: the shard needs no more room than its bytes.
  uint64_t size_hint = 0;
  FileDigestBuilder digest;
  uint64_t direct_bytes = 0;    // raw bytes written with O_DIRECT
  uint64_t buffered_bytes = 0;  // everything else (metadata, edges of raw writes)
};

// Makes `fapl` create the file through the shard driver, logging into `log`, which must outlive
// the file. Also sizes HDF5's metadata aggregation so that metadata gathers in a few large blocks
// instead of between the raw data (each interruption costs the digest a block read back).
void use_shard_driver(hid_t fapl, ShardFileLog* log);

}  // namespace t3d::checkpoint
