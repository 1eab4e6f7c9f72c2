// Where a query row and a request's cache rows lie, for the attention kernels whose arguments hold q [batch,
// heads, queries, dim], slots [batch] and one layer's cache [slots, kv_heads, capacity, dim].
#pragma once

#include "hd.h"

namespace dflash {

template <typename Args>
DFLASH_HD auto query_row(const Args& a, int64_t b, int64_t h, int64_t i) {
  return a.q + ((b * a.heads + h) * a.queries + i) * a.dim;
}

// Offset of (entry b's slot, kv head g, position 0) in the cache.
template <typename Args>
DFLASH_HD int64_t cache_offset(const Args& a, int64_t b, int64_t g) {
  return (a.slots[b] * a.kv_heads + g) * a.capacity * a.dim;
}

}  // namespace dflash
