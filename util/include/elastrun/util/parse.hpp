// Parsing the small values that flags, environment variables and plugin arguments carry:
// integers, booleans and comma lists. One grammar each for the agent, the plugin and rdzv, so a
// value accepted in one place is accepted in all. Dependency-free (standard library only).
#pragma once

#include <charconv>
#include <concepts>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace elastrun::util {

// The whole of `text` as a base-10 integer of type T (a leading '-' only for signed T); nullopt
// for an empty text, trailing characters, or a value T cannot hold.
template <std::integral T>
std::optional<T> parse_integer(std::string_view text) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return value;
}

// parse_integer, and within [lo, hi].
template <std::integral T>
std::optional<T> parse_integer_in(std::string_view text, T lo, T hi) {
  auto value = parse_integer<T>(text);
  if (!value || *value < lo || *value > hi) return std::nullopt;
  return value;
}

// Booleans, case-insensitive: true = 1, true, yes, on; false = 0, false, no, off.
inline std::optional<bool> parse_boolean(std::string_view text) {
  const auto is = [&](std::string_view word) {
    if (text.size() != word.size()) return false;
    for (std::size_t i = 0; i < text.size(); ++i) {
      char c = text[i];
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      if (c != word[i]) return false;
    }
    return true;
  };
  for (auto word : {"1", "true", "yes", "on"})
    if (is(word)) return true;
  for (auto word : {"0", "false", "no", "off"})
    if (is(word)) return false;
  return std::nullopt;
}

// "a,b,,c" -> {"a", "b", "", "c"}: items in order, empty ones kept (callers decide whether an
// empty item is an error); a trailing separator ends the list ("a," -> {"a"}); "" -> {}.
inline std::vector<std::string_view> split_list(std::string_view text, char separator = ',') {
  std::vector<std::string_view> items;
  while (!text.empty()) {
    const auto at = text.find(separator);
    items.push_back(text.substr(0, at));
    text = at == std::string_view::npos ? std::string_view{} : text.substr(at + 1);
  }
  return items;
}

// Text from a peer made safe for one log line: bytes outside printable ASCII become \xNN and
// anything past `max` bytes is cut ("..." marks the cut).
inline std::string printable(std::string_view text, std::size_t max = 200) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < text.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (text.size() > max) out += "...";
  return out;
}

}  // namespace elastrun::util
