/* EXPECT, the check of the C and C++ tests: when cond is false it prints
 * where, the condition and an optional printf-style message (a string
 * literal first), counts the failure in `failures` and goes on, so that one
 * run reports every failure. Each test ends by printing failures and
 * exiting non-zero if there were any. */
#ifndef GOALLOC_TESTS_EXPECT_H
#define GOALLOC_TESTS_EXPECT_H

#include <stdio.h>

static int failures = 0;

#define EXPECT(cond, ...)                                                   \
	do {                                                                \
		if (!(cond)) {                                              \
			fprintf(stderr, "FAIL %s:%d: %s:", __FILE__, __LINE__, #cond);  \
			fprintf(stderr, " " __VA_ARGS__);                   \
			fprintf(stderr, "\n");                              \
			failures++;                                         \
		}                                                           \
	} while (0)

#endif
