// elastrun/util: the one grammar for integers, booleans and comma lists, and UniqueFd.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>

#include "elastrun/util/parse.hpp"
#include "elastrun/util/unique_fd.hpp"

namespace elastrun::util {
namespace {

TEST(UtilParse, Integers) {
  EXPECT_EQ(parse_integer<int>("42"), 42);
  EXPECT_EQ(parse_integer<int>("-3"), -3);
  EXPECT_FALSE(parse_integer<unsigned>("-3"));
  EXPECT_FALSE(parse_integer<int>(""));
  EXPECT_FALSE(parse_integer<int>("4x"));
  EXPECT_FALSE(parse_integer<int>(" 4"));
  EXPECT_FALSE(parse_integer<int>("99999999999"));
  EXPECT_EQ(parse_integer<std::uint64_t>("18446744073709551615"), UINT64_MAX);
  EXPECT_EQ(parse_integer_in("65535", 1u, 65535u), 65535u);
  EXPECT_FALSE(parse_integer_in("0", 1u, 65535u));
  EXPECT_FALSE(parse_integer_in("65536", 1u, 65535u));
}

TEST(UtilParse, BooleansAreTheUnionOfEveryEarlierGrammar) {
  for (auto t : {"1", "true", "True", "TRUE", "yes", "Yes", "on", "ON"}) EXPECT_EQ(parse_boolean(t), true) << t;
  for (auto f : {"0", "false", "False", "no", "NO", "off", "Off"}) EXPECT_EQ(parse_boolean(f), false) << f;
  for (auto bad : {"", "2", "y", "n", "truee", " true", "enabled"}) EXPECT_FALSE(parse_boolean(bad)) << bad;
}

TEST(UtilParse, ByteSizes) {
  EXPECT_EQ(parse_byte_size("1048576"), 1048576u);
  EXPECT_EQ(parse_byte_size("64M"), 64u << 20);
  EXPECT_EQ(parse_byte_size("64mib"), 64u << 20);
  EXPECT_EQ(parse_byte_size("2GiB"), 2ull << 30);
  EXPECT_EQ(parse_byte_size("512KB"), 512u << 10);
  EXPECT_EQ(parse_byte_size("1T"), 1ull << 40);
  for (auto bad : {"", "M", "1.5G", "-1", "8X", "8 G", "8GG", "99999999999999999999", "17179869184T"})
    EXPECT_FALSE(parse_byte_size(bad)) << bad;
}

TEST(UtilParse, Lists) {
  EXPECT_EQ(split_list("a,b,,c"), (std::vector<std::string_view>{"a", "b", "", "c"}));
  EXPECT_EQ(split_list("a,"), (std::vector<std::string_view>{"a"}));
  EXPECT_EQ(split_list(",a"), (std::vector<std::string_view>{"", "a"}));
  EXPECT_TRUE(split_list("").empty());
  EXPECT_EQ(split_list("k=v;x", ';'), (std::vector<std::string_view>{"k=v", "x"}));
}

TEST(UtilParse, PrintableEscapesAndCuts) {
  EXPECT_EQ(elastrun::util::printable("run-1.r0"), "run-1.r0");
  EXPECT_EQ(elastrun::util::printable(std::string_view("a\nb\x1b\\\xff", 6)), "a\\x0ab\\x1b\\x5c\\xff");
  EXPECT_EQ(elastrun::util::printable(std::string(300, 'x'), 4), "xxxx...");
}

TEST(UtilUniqueFd, ClosesOnceAndMoves) {
  int raw = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(raw, 0);
  {
    UniqueFd a(raw);
    UniqueFd b(std::move(a));
    EXPECT_FALSE(a);
    EXPECT_EQ(b.get(), raw);
    UniqueFd c;
    c = std::move(b);
    EXPECT_EQ(c.get(), raw);
    EXPECT_GE(::fcntl(raw, F_GETFD), 0);
  }
  EXPECT_EQ(::fcntl(raw, F_GETFD), -1) << "not closed at the end of its owner";
  UniqueFd d(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  const int released = d.release();
  EXPECT_FALSE(d);
  EXPECT_EQ(::close(released), 0) << "release() must not close";
}

}  // namespace
}  // namespace elastrun::util
