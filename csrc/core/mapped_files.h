// mapped_files.h: the memory-mapped weight files of the loaded models, for the SIGBUS handler.
//
// A file truncated or overwritten in place under its mapping turns the next read of a vanished page into SIGBUS,
// which kills the process. The handler (installed with the first registration) finds the file whose mapping holds
// the faulting address, writes one line naming it to stderr, then lets the signal take its course: it restores
// the previous disposition (Python's faulthandler, or the default) and the process still dies of SIGBUS. A SIGBUS
// at any other address is passed to the previous disposition unremarked.
#pragma once
#include <cstddef>
#include <string>

namespace lily {

// Registers [begin, begin + bytes) as the mapping of `path`. Returns an id for remove_mapped_file, or -1 when the
// registry is full (kMaxMappedFiles; a SIGBUS in that file then goes unexplained).
int add_mapped_file(const void* begin, size_t bytes, const std::string& path);
void remove_mapped_file(int id);
constexpr int kMaxMappedFiles = 256;

}  // namespace lily
