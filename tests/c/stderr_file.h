/* The lines a test provokes on stderr on purpose (the out-of-memory line a
 * refused goalloc_malloc prints) go to a file while the bad call runs and are
 * checked there, instead of showing in a passing run:
 *
 *   stderr_to_file();
 *   ... the call that prints ...
 *   n = stderr_back("goalloc: CUDA out of memory.");
 *
 * stderr_back restores stderr, counts the captured lines holding want and
 * prints every other captured line, so that nothing unexpected is hidden. */
#ifndef GOALLOC_TESTS_STDERR_FILE_H
#define GOALLOC_TESTS_STDERR_FILE_H

#include <stdio.h>
#include <string.h>
#include <unistd.h>

static FILE *stderr_file;
static int stderr_saved = -1;

static void stderr_to_file(void) {
	fflush(stderr);
	stderr_file = tmpfile();
	stderr_saved = stderr_file ? dup(2) : -1;
	if (stderr_saved >= 0) dup2(fileno(stderr_file), 2);
}

static int stderr_back(const char *want) {
	char line[4096];
	int n = 0;
	fflush(stderr);
	if (stderr_saved < 0) return -1; /* never redirected: the line was shown */
	dup2(stderr_saved, 2);
	close(stderr_saved);
	stderr_saved = -1;
	rewind(stderr_file);
	while (fgets(line, sizeof line, stderr_file)) {
		if (strstr(line, want)) n++;
		else fputs(line, stderr);
	}
	fclose(stderr_file);
	return n;
}

#endif
