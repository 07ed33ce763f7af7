// libxxhash for the KV transports' payload hashes (XXH3-64), with its run-time dispatch on x86:
// XXH3_64bits and XXH3_64bits_update then run libxxhash's AVX2 or AVX-512 variant where the core
// has it (Debian builds the plain entry points for the baseline instruction set: ~3.5x slower on
// this machine's cores, slower than the memcpy it checks). Internal to comm/.
#pragma once

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t by value
#include <xxhash.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h>
#endif
