// Parsing the small values that flags, environment variables and plugin arguments carry:
// integers, booleans and comma lists. One grammar each for the agent, the plugin and rdzv, so a
// value accepted in one place is accepted in all. Dependency-free (standard library only).
#pragma once

#include <charconv>
#include <concepts>
#include <cstdint>
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

// A size in bytes: an integer with an optional binary multiple, case-insensitive: K, M, G, T
// (also KB/KiB, ...): "64M" = 64 MiB, "2GiB", "1048576". nullopt for anything else or an overflow.
inline std::optional<std::uint64_t> parse_byte_size(std::string_view text) {
  std::size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  const auto number = parse_integer<std::uint64_t>(text.substr(0, digits));
  if (!number) return std::nullopt;
  std::string unit;
  for (char c : text.substr(digits)) unit += static_cast<char>(c >= 'a' && c <= 'z' ? c - 'a' + 'A' : c);
  int shift = 0;
  if (!unit.empty()) {
    const std::string_view letters = "KMGT";
    const auto at = letters.find(unit.front());
    const std::string_view rest = std::string_view(unit).substr(1);
    if (at == std::string_view::npos || !(rest.empty() || rest == "B" || rest == "IB")) return std::nullopt;
    shift = 10 * static_cast<int>(at + 1);
  }
  if (shift > 0 && *number > (UINT64_MAX >> shift)) return std::nullopt;
  return *number << shift;
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
