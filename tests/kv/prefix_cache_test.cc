// PrefixCache on its own: a hit needs equal tokens and the same parent, whatever the hash says;
// the evictable list is least recently released first.
#include "kv/prefix_cache.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvshard::kv {
namespace {

TEST(ChainHashTest, DependsOnParentAndEveryToken) {
    const std::vector<int32_t> a = {1, 2, 3, 4};
    std::vector<int32_t> b = a;
    b[3] = 5;
    EXPECT_EQ(ChainHash(kRootHash, a), ChainHash(kRootHash, a));
    EXPECT_NE(ChainHash(kRootHash, a), ChainHash(kRootHash, b));
    EXPECT_NE(ChainHash(kRootHash, a), ChainHash(ChainHash(kRootHash, b), a));
}

// The BlockManager never lets a hash stand for tokens. Here the hashes are chosen by hand to
// collide, which xxh3 will not do on demand.
TEST(PrefixCacheTest, HitsAreVerifiedNotTrustedToTheHash) {
    PrefixCache cache(8, 4);
    const std::vector<int32_t> tokens = {7, 7, 7, 7};
    const std::vector<int32_t> other = {7, 7, 7, 8};
    const uint64_t root = cache.Insert(3, /*hash=*/42, kRootContentId, tokens);
    struct Case {
        const char* name;
        uint64_t hash;
        uint64_t parent;
        std::vector<int32_t> tokens;
        std::optional<BlockId> want;
    };
    const Case cases[] = {
        {"exact", 42, kRootContentId, tokens, 3},
        {"same hash, other tokens (a collision)", 42, kRootContentId, other, std::nullopt},
        {"same hash and tokens, other parent", 42, root + 100, tokens, std::nullopt},
        {"other hash", 43, kRootContentId, tokens, std::nullopt},
        {"short token list", 42, kRootContentId, {7, 7, 7}, std::nullopt},
    };
    for (const Case& c : cases) {
        EXPECT_EQ(cache.Find(c.hash, c.parent, c.tokens), c.want) << c.name;
    }
    // A child links to its parent's content id, never reused even when the block id is.
    const uint64_t child = cache.Insert(5, 99, root, other);
    EXPECT_NE(child, root);
    EXPECT_EQ(cache.Find(99, root, other), 5);
    EXPECT_EQ(cache.ParentContentId(5), root);
    EXPECT_TRUE(cache.ContainsHash(42));
    EXPECT_EQ(cache.num_cached(), 2);
}

TEST(PrefixCacheTest, EvictsLeastRecentlyReleasedFirst) {
    PrefixCache cache(8, 2);
    const std::vector<int32_t> t = {1, 2};
    for (BlockId b : {4, 1, 6, 2}) cache.Insert(b, 1000 + b, kRootContentId, t);
    EXPECT_EQ(cache.num_evictable(), 0) << "inserted blocks are referenced";
    for (BlockId b : {6, 1, 4, 2}) cache.Release(b);
    EXPECT_EQ(cache.EvictionOrder(), (std::vector<BlockId>{6, 1, 4, 2}));
    cache.Acquire(1);  // a hit: no longer evictable
    EXPECT_EQ(cache.EvictionOrder(), (std::vector<BlockId>{6, 4, 2}));
    cache.Release(1);  // released again: most recent
    EXPECT_EQ(cache.EvictLru(), 6);
    EXPECT_FALSE(cache.IsCached(6));
    EXPECT_FALSE(cache.ContainsHash(1006));
    EXPECT_EQ(cache.EvictLru(), 4);
    EXPECT_EQ(cache.EvictionOrder(), (std::vector<BlockId>{2, 1}));
    EXPECT_EQ(cache.num_cached(), 2);
    EXPECT_EQ(cache.num_evictable(), 2);
    // An evicted block id can be published again with new content.
    const uint64_t id = cache.Insert(6, 77, kRootContentId, t);
    EXPECT_EQ(cache.ContentId(6), id);
}

}  // namespace
}  // namespace kvshard::kv
