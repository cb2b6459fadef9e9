// The only file that knows Python. Array arguments are zero-copy views; batch calls release the
// GIL. Input validation that needs Python context (ids, vocabulary) lives in the Python wrapper.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "datastore.h"
#include "draft_tree.h"
#include "drafter.h"
#include "input_trie.h"
#include "params.h"
#include "suffix_array.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

template <typename T>
using InArray = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
template <typename T>
using OutArray = nb::ndarray<nb::numpy, T, nb::ndim<1>>;

// Moves a vector into a NumPy array that owns it.
template <typename T>
OutArray<T> to_numpy(std::vector<T>&& values) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return OutArray<T>(owned->data(), {owned->size()}, owner);
}

template <typename T>
std::span<const T> view(const InArray<T>& array) {
  return std::span<const T>(array.data(), array.shape(0));
}

// A Datastore plus the arrays it views, so the memory outlives every call that uses it.
struct BoundDatastore {
  std::vector<InArray<uint32_t>> owners;
  std::unique_ptr<sssd::Datastore> datastore;
};

// [num_nodes, 4] int32: token, count, first_child, next_sibling.
nb::ndarray<nb::numpy, int32_t, nb::ndim<2>> export_nodes(const sssd::CountTree& tree) {
  auto* owned = new std::vector<int32_t>();
  owned->reserve(static_cast<size_t>(tree.size()) * 4);
  for (int32_t i = 0; i < tree.size(); ++i) {
    const sssd::CountNode& n = tree.node(i);
    owned->insert(owned->end(), {n.token, n.count, n.first_child, n.next_sibling});
  }
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
  return nb::ndarray<nb::numpy, int32_t, nb::ndim<2>>(
      owned->data(), {static_cast<size_t>(tree.size()), 4}, owner);
}

}  // namespace

NB_MODULE(_core, m) {
  // Objects still referenced from daemon threads at interpreter exit are not leaks worth a
  // warning on every shutdown.
  nb::set_leak_warnings(false);
  m.doc() = "C++ core of the SSSD drafter (input trie, suffix-array datastore, merge).";

  nb::class_<sssd::DrafterParams>(m, "DrafterParams")
      .def(nb::init<>())
      .def_rw("prefix_len", &sssd::DrafterParams::prefix_len)
      .def_rw("branch_len", &sssd::DrafterParams::branch_len)
      .def_rw("max_continuations", &sssd::DrafterParams::max_continuations)
      .def_rw("min_continuations", &sssd::DrafterParams::min_continuations)
      .def_rw("datastore_discount", &sssd::DrafterParams::datastore_discount)
      .def_rw("input_discount", &sssd::DrafterParams::input_discount)
      .def_rw("datastore_child_discount", &sssd::DrafterParams::datastore_child_discount)
      .def_rw("input_child_discount_base", &sssd::DrafterParams::input_child_discount_base)
      .def_rw("input_child_discount_per_match",
              &sssd::DrafterParams::input_child_discount_per_match)
      .def_rw("copy_min_match", &sssd::DrafterParams::copy_min_match)
      .def_rw("copy_len", &sssd::DrafterParams::copy_len)
      .def_rw("copy_discount", &sssd::DrafterParams::copy_discount)
      .def_rw("copy_child_discount", &sssd::DrafterParams::copy_child_discount)
      .def("validate", [](const sssd::DrafterParams& p) { return std::string(p.validate()); },
           "'' if every field is in range, else what is wrong.");

  nb::class_<sssd::InputTrie>(m, "InputTrie")
      .def(nb::init<int32_t>(), "branch_len"_a)
      .def(
          "append",
          [](sssd::InputTrie& trie, const InArray<int32_t>& tokens) {
            nb::gil_scoped_release release;
            std::lock_guard<std::mutex> lock(trie.mutex());
            trie.append(view(tokens));
          },
          "tokens"_a, "Appends accepted tokens (int32 array) to the sequence.")
      .def("match", &sssd::InputTrie::match, "prefix_len"_a,
           "Algorithm 1: (node, match_len) for every suffix of the prefix found, longest first.")
      .def("copy_match", &sssd::InputTrie::copy_match, "min_len"_a,
           "The copy source's match: (end, match_len) of the latest earlier occurrence of the "
           "longest suffix of at least min_len tokens; end -1 if none.")
      .def("tokens", [](const sssd::InputTrie& trie) {
        return to_numpy(std::vector<int32_t>(trie.tokens()));
      })
      .def("nodes", [](const sssd::InputTrie& trie) { return export_nodes(trie.tree()); },
           "[num_nodes, 4] int32: token, count, first_child, next_sibling; node 0 is the root.")
      .def("check", [](const sssd::InputTrie& trie) { return trie.tree().check(); },
           "Invariant checker: '' if sound, else the first violation.")
      .def_prop_ro("num_tokens",
                   [](const sssd::InputTrie& trie) { return trie.tokens().size(); });

  nb::class_<sssd::InputMatch>(m, "InputMatch")
      .def_ro("node", &sssd::InputMatch::node)
      .def_ro("match_len", &sssd::InputMatch::match_len);

  nb::class_<sssd::CopyMatch>(m, "CopyMatch")
      .def_ro("end", &sssd::CopyMatch::end)
      .def_ro("match_len", &sssd::CopyMatch::match_len);

  nb::class_<BoundDatastore>(m, "Datastore")
      .def(
          "__init__",
          [](BoundDatastore* self, const std::vector<nb::tuple>& shards, uint32_t vocab_size,
             int32_t max_continuations) {
            new (self) BoundDatastore();
            std::vector<sssd::ShardView> views;
            for (const nb::tuple& shard : shards) {
              if (shard.size() != 3 && shard.size() != 4) {
                throw std::invalid_argument(
                    "a shard is (stream, suffix_array, bucket_starts[, weight])");
              }
              auto stream = nb::cast<InArray<uint32_t>>(shard[0]);
              auto suffix_array = nb::cast<InArray<uint32_t>>(shard[1]);
              auto buckets = nb::cast<InArray<uint32_t>>(shard[2]);
              const int32_t weight = shard.size() == 4 ? nb::cast<int32_t>(shard[3]) : 1;
              views.push_back(
                  sssd::ShardView{view(stream), view(suffix_array), view(buckets), weight});
              self->owners.push_back(stream);
              self->owners.push_back(suffix_array);
              self->owners.push_back(buckets);
            }
            self->datastore =
                std::make_unique<sssd::Datastore>(std::move(views), vocab_size, max_continuations);
          },
          "shards"_a, "vocab_size"_a, "max_continuations"_a,
          "Views over (stream, suffix_array, bucket_starts) uint32 arrays, each with an optional "
          "integer weight (default 1, see docs/algorithm.md); nothing is copied.")
      .def_prop_ro("num_shards", [](const BoundDatastore& d) { return d.datastore->num_shards(); })
      .def_prop_ro("num_tokens", [](const BoundDatastore& d) { return d.datastore->num_tokens(); })
      .def_prop_ro("vocab_size", [](const BoundDatastore& d) { return d.datastore->vocab_size(); })
      .def_prop_ro("quotas", [](const BoundDatastore& d) { return d.datastore->quotas(); })
      .def(
          "find",
          [](const BoundDatastore& d, int32_t shard, const InArray<int32_t>& query) {
            if (shard < 0 || shard >= d.datastore->num_shards()) {
              throw std::out_of_range("no such shard");
            }
            const sssd::SaRange r = d.datastore->find(shard, view(query));
            return std::make_pair(r.begin, r.end);
          },
          "shard"_a, "query"_a, "Suffix-array rows [begin, end) whose suffixes start with query.")
      .def(
          "collect",
          [](const BoundDatastore& d, const InArray<int32_t>& sequence,
             const sssd::DrafterParams& params) {
            if (sequence.shape(0) == 0) throw std::invalid_argument("empty sequence");
            sssd::CountTree tree;
            {
              nb::gil_scoped_release release;
              d.datastore->collect(view(sequence), params, tree);
            }
            return export_nodes(tree);
          },
          "sequence"_a, "params"_a, "Algorithm 2: the datastore tree as exported nodes.")
      .def(
          "check_shard",
          [](const BoundDatastore& d, int32_t shard, bool check_order) {
            if (shard < 0 || shard >= d.datastore->num_shards()) {
              throw std::out_of_range("no such shard");
            }
            nb::gil_scoped_release release;
            return d.datastore->check_shard(shard, check_order);
          },
          "shard"_a, "check_order"_a = true,
          "Invariant checker for one shard: '' if sound, else the first violation.");

  nb::class_<sssd::BatchDrafter>(m, "BatchDrafter")
      .def(nb::init<const sssd::DrafterParams&, int32_t>(), "params"_a, "num_threads"_a)
      .def_prop_ro("num_threads", &sssd::BatchDrafter::num_threads)
      .def_prop_ro("params", &sssd::BatchDrafter::params)
      .def(
          "propose",
          [](sssd::BatchDrafter& drafter, const BoundDatastore* datastore,
             const std::vector<sssd::InputTrie*>& tries, const InArray<int32_t>& new_tokens,
             const InArray<int64_t>& cu_num_new_tokens, const InArray<int32_t>& budgets) {
            for (sssd::InputTrie* trie : tries) {
              if (trie == nullptr) throw std::invalid_argument("a trie is None");
            }
            sssd::DraftBatch batch;
            {
              nb::gil_scoped_release release;
              drafter.propose(datastore ? datastore->datastore.get() : nullptr, tries,
                              view(new_tokens), view(cu_num_new_tokens), view(budgets), batch);
            }
            return nb::make_tuple(to_numpy(std::move(batch.token_ids)),
                                  to_numpy(std::move(batch.parents)),
                                  to_numpy(std::move(batch.probs)),
                                  to_numpy(std::move(batch.cu_num_nodes)));
          },
          "datastore"_a.none(), "tries"_a, "new_tokens"_a, "cu_num_new_tokens"_a, "budgets"_a,
          "Appends new tokens and drafts one tree per row. Returns (token_ids, parents, probs, "
          "cu_num_nodes).")
      .def(
          "propose_one",
          [](const sssd::BatchDrafter& drafter, const BoundDatastore* datastore,
             sssd::InputTrie& trie, int32_t budget) {
            if (trie.tokens().empty()) throw std::invalid_argument("the sequence is empty");
            if (budget < 1) throw std::invalid_argument("budget must be >= 1");
            sssd::DraftTree tree;
            {
              nb::gil_scoped_release release;
              std::lock_guard<std::mutex> lock(trie.mutex());
              drafter.propose_one(datastore ? datastore->datastore.get() : nullptr, trie, budget,
                                  tree);
            }
            return nb::make_tuple(to_numpy(std::move(tree.token_ids)),
                                  to_numpy(std::move(tree.parents)),
                                  to_numpy(std::move(tree.probs)));
          },
          "datastore"_a.none(), "trie"_a, "budget"_a,
          "Drafts one tree without appending. Returns (token_ids, parents, probs).");

  m.def(
      "build_suffix_array",
      [](const InArray<uint32_t>& stream, uint32_t vocab_size) {
        std::vector<uint32_t> sa(stream.shape(0));
        {
          nb::gil_scoped_release release;
          sssd::build_suffix_array(view(stream), vocab_size, sa);
        }
        return to_numpy(std::move(sa));
      },
      "stream"_a, "vocab_size"_a,
      "SA-IS suffix array (uint32) of a token stream; 0xFFFFFFFF separates documents.");

  m.def(
      "check_draft_tree",
      [](const InArray<int32_t>& token_ids, const InArray<int32_t>& parents,
         const InArray<float>& probs, int32_t max_nodes, int32_t root_token) {
        sssd::DraftTree tree;
        tree.token_ids.assign(token_ids.data(), token_ids.data() + token_ids.shape(0));
        tree.parents.assign(parents.data(), parents.data() + parents.shape(0));
        tree.probs.assign(probs.data(), probs.data() + probs.shape(0));
        return sssd::check_draft_tree(tree, max_nodes, root_token);
      },
      "token_ids"_a, "parents"_a, "probs"_a, "max_nodes"_a, "root_token"_a,
      "Invariant checker for a draft tree: '' if sound, else the first violation.");

  m.def("apportion", &sssd::apportion, "total"_a, "sizes"_a,
        "Largest-remainder split of total over shards in proportion to sizes.");

  m.attr("DOCUMENT_SEPARATOR") = sssd::kDocumentSeparator;
  m.attr("MAX_SHARD_WEIGHT") = sssd::kMaxShardWeight;
}
