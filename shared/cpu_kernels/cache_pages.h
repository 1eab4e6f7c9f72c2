// Where a slot's positions lie in one layer's KV cache [num_pages, kv_heads, page_size, dim]: the slot's position p
// is row p % page_size of page table[slot, p / page_size]. A cache of one page per slot (page = slot, page_size =
// its capacity) is the case pages_per_slot == 1 with an identity table. Mirrored by shared/cpu_kernels/arguments.py.
#pragma once

#include <cstdint>

extern "C" {

struct CachePages {
  const int64_t* table;  // [num_slots, pages_per_slot]
  int64_t num_slots, pages_per_slot, page_size, num_pages;
};

}  // extern "C"

namespace dflash {

// Keys attention reads as one block (attention.cpp: a block's keys and values stay in L1 across the rows); a
// cache of several pages a slot has pages of a multiple of it.
constexpr int64_t kKeyBlock = 64;

inline int64_t cache_capacity(const CachePages& pages) { return pages.pages_per_slot * pages.page_size; }

inline int64_t cache_page(const CachePages& pages, int64_t slot, int64_t position) {
  return pages.table[slot * pages.pages_per_slot + position / pages.page_size];
}

// The element offset of (slot, kv head, position)'s row of dim elements.
inline int64_t cache_row(const CachePages& pages, int64_t kv_heads, int64_t slot, int64_t head, int64_t position,
                         int64_t dim) {
  return ((cache_page(pages, slot, position) * kv_heads + head) * pages.page_size + position % pages.page_size) * dim;
}

// Whether the slot's position lies in the cache: slot and position in range, and the page its table names.
inline bool cache_holds(const CachePages& pages, int64_t slot, int64_t position) {
  if (slot < 0 || slot >= pages.num_slots || position < 0 || position >= cache_capacity(pages)) return false;
  const int64_t page = cache_page(pages, slot, position);
  return page >= 0 && page < pages.num_pages;
}

// Whether attention can read the pages: its key blocks of key_block positions never straddle two pages.
inline bool cache_pages_fit(const CachePages& pages, int64_t key_block) {
  return pages.page_size > 0 && (pages.pages_per_slot == 1 || pages.page_size % key_block == 0);
}

// Whether every page holding the slot's first `keys` positions is in range (attention reads them all).
inline bool cache_reads(const CachePages& pages, int64_t slot, int64_t keys) {
  for (int64_t p = 0; p < keys; p += pages.page_size) {
    if (!cache_holds(pages, slot, p)) return false;
  }
  return true;
}

}  // namespace dflash
