// Internal: the ordered-list registry and the selector with reasons, shared by the attention
// backends (registry.cpp, selector.cpp) and the MLA prefill backends (mla/prefill_registry.cpp).
//
//   build_ordered_registry   the table's entries in priority order; two entries with the same
//                            case-insensitive name are an Error naming the registry
//   find_in_registry         by case-insensitive name, nullptr when none
//   select_from_registry     a forced name (the argument, else the environment variable) picks
//                            one entry or fails with its reasons; otherwise the first entry with
//                            no reasons wins; when none fits, the Error lists every entry with
//                            every reason, one line each
#pragma once

#include <cctype>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "pagedattn/error.h"

namespace pagedattn::detail {

inline bool equal_ignoring_case(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

inline std::string join_reasons(const std::vector<std::string>& reasons) {
  std::string out;
  for (const std::string& r : reasons) {
    if (!out.empty()) out += ' ';
    out += r;
  }
  return out;
}

// How one registry names things in its errors.
template <class T>
struct RegistryWords {
  std::string_view (*name_of)(const T&);
  std::string_view registry;   // "backend registry"
  std::string_view entry;      // "backend" (in "forces backend X", "two backends are named")
  std::string_view noun;       // "attention backend" (in "is not a registered ...", "no ... supports")
  std::string_view argument;   // Error argument of a forced name: "backend"
  const char* env;             // the variable read when no name is forced: "PAGEDATTN_BACKEND"
  std::string_view function;   // "get_attn_backend"
};

template <class T, size_t N>
std::vector<const T*> build_ordered_registry(const T& (*const (&table)[N])(),
                                             const RegistryWords<T>& words) {
  std::vector<const T*> entries;
  for (const auto accessor : table) {
    const T* entry = &accessor();
    for (const T* other : entries) {
      PAGEDATTN_CHECK(!equal_ignoring_case(words.name_of(*other), words.name_of(*entry)),
                      std::string(words.argument), words.registry, ": two ", words.entry,
                      "s are named \"", words.name_of(*entry),
                      "\" (names are case-insensitive and must be unique)");
    }
    entries.push_back(entry);
  }
  return entries;
}

template <class T>
const T* find_in_registry(const std::vector<const T*>& entries, std::string_view name,
                          const RegistryWords<T>& words) {
  for (const T* entry : entries) {
    if (equal_ignoring_case(words.name_of(*entry), name)) return entry;
  }
  return nullptr;
}

// reasons_of(entry) -> std::vector<std::string> (empty = usable). `configuration` describes what
// was asked, e.g. "(head_size=72, dtype=bfloat16, ...)".
template <class T, class ReasonsOf>
const T& select_from_registry(const std::vector<const T*>& entries, std::string_view forced,
                              const std::string& configuration, ReasonsOf&& reasons_of,
                              const RegistryWords<T>& words) {
  std::string_view source = words.argument;
  std::string name(forced);
  if (name.empty()) {
    const char* env = std::getenv(words.env);
    if (env != nullptr && *env != '\0') {
      name = env;
      source = words.env;
    }
  }
  if (!name.empty()) {
    const T* entry = find_in_registry(entries, name, words);
    if (entry == nullptr) {
      std::string registered;
      for (const T* e : entries) {
        if (!registered.empty()) registered += ", ";
        registered += words.name_of(*e);
      }
      throw Error(std::string(source), concat(words.function, ": ", source, " = \"", name,
                                              "\" is not a registered ", words.noun,
                                              " (registered: ", registered, ")"));
    }
    const std::vector<std::string> reasons = reasons_of(*entry);
    PAGEDATTN_CHECK(reasons.empty(), std::string(source), words.function, ": ", source, " = \"",
                    name, "\" forces ", words.entry, " ", words.name_of(*entry),
                    ", which does not support this configuration ", configuration, ": ",
                    join_reasons(reasons));
    return *entry;
  }
  std::string details;
  for (const T* entry : entries) {
    const std::vector<std::string> reasons = reasons_of(*entry);
    if (reasons.empty()) return *entry;
    details += "\n  ";
    details += words.name_of(*entry);
    details += ": ";
    details += join_reasons(reasons);
  }
  throw Error(concat("no ", words.noun, " supports this configuration ", configuration, ":",
                     details));
}

}  // namespace pagedattn::detail

namespace pagedattn {
class AttentionBackend;
namespace detail {
// The attention backends' words (registry.cpp), for the selector (selector.cpp).
extern const RegistryWords<AttentionBackend> attention_backend_registry_words;
}  // namespace detail
}  // namespace pagedattn
