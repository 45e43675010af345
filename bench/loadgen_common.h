/* What bench/loadgen.c (sbus) and bench/loadgen_peers.c (NATS, RESP, MQTT) share: the
 * clock, a process's CPU time from /proc, and the sort order for latency percentiles.
 * Included by both (static functions: each program is one translation unit). */

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double
mono(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* utime + stime of a process, in seconds; -1 if unknown. */
static double
cpu_of(long pid)
{
	char path[64], buf[4096], *p;
	unsigned long ut, st;
	FILE *f;
	size_t n;
	if (pid <= 0)
		return -1;
	snprintf(path, sizeof path, "/proc/%ld/stat", pid);
	if (!(f = fopen(path, "r")))
		return -1;
	n = fread(buf, 1, sizeof buf - 1, f);
	fclose(f);
	buf[n] = 0;
	if (!(p = strrchr(buf, ')')))
		return -1;
	/* after ") ": state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime */
	if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
		return -1;
	return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static int
cmpd(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}
