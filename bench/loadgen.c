/* loadgen: the sbus project's load generator. It speaks the sbus wire protocol
 * (docs/protocol.md) over a unix SOCK_SEQPACKET socket, so one run measures any
 * server: ours, the reference C sbusd, or bench/forwarder.c.
 *
 *   loadgen fanout SOCK SUBS MSGS SIZE NOISE_CLIENTS NOISE_PATTERNS
 *       NOISE_CLIENTS clients each hold NOISE_PATTERNS patterns that match
 *       nothing published; SUBS subscribers each hold 'bench/'; one publisher
 *       (a forked process) sends MSGS messages of SIZE payload bytes on
 *       'bench/x/y'. The parent reads every subscriber.
 *   loadgen many SOCK CLIENTS PUBLISHERS MSGS SIZE
 *       CLIENTS connected clients; client i holds 'bench/m/<i mod PUBLISHERS>',
 *       so each key is matched by CLIENTS/PUBLISHERS subscribers; clients
 *       0..PUBLISHERS-1 each publish MSGS messages on their own key (round
 *       robin, from a forked process), and receive their own (echo is on).
 *   loadgen rtt SOCK ROUNDS
 *       one client holds 'ping', publishes on it and waits for its own copy.
 *
 * Subscribers send 'CMSG blocking/soft/block' first, so a server with flood
 * control holds publishers back instead of dropping. Payloads carry a sequence
 * number: every subscriber checks it receives each message once, in order.
 * fanout/many print one line
 *   ... delivered=GOT/WANT wall=S s published/s=N delivered/s=N [server_cpu_s=S]
 * and exit 0 when every message arrived in order, 1 when some were lost or
 * reordered (after 30 s without progress), 2 on a setup failure. With
 * SBUS_BENCH_SERVER_PID set, the server's CPU time (utime + stime from
 * /proc/PID/stat) over the publishing phase is added as server_cpu_s.
 * rtt prints median_us and p99_us.
 *
 * With SBUS_BENCH_PUBLISH_TO=PATH, fanout's publisher connects to PATH instead
 * (another bus, joined to SOCK by a relay, bridge, link, ...: bench/services.py):
 * first it sends 'MSG bench/warmup' every 50 ms until every subscriber has one
 * (the path is up), and the subscribers skip those.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "loadgen_common.h"

#define STALL_S 30.0
#define RBUF (512 * 1024)

static void
die(const char *what)
{
	fprintf(stderr, "loadgen: %s: %s\n", what, strerror(errno));
	exit(2);
}



static long
server_pid(void)
{
	const char *s = getenv("SBUS_BENCH_SERVER_PID");
	return s ? atol(s) : 0;
}

static int
dial(const char *path)
{
	struct sockaddr_un a;
	int fd, i;
	if ((fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0)) < 0)
		die("socket");
	memset(&a, 0, sizeof a);
	a.sun_family = AF_UNIX;
	strncpy(a.sun_path, path, sizeof a.sun_path - 1);
	for (i = 0; i < 500; i++) {
		if (!connect(fd, (struct sockaddr *)&a, sizeof a))
			return fd;
		if (errno != EAGAIN && errno != ENOENT && errno != ECONNREFUSED)
			break;
		usleep(10000);
	}
	die("connect");
	return -1;
}

static void
put(int fd, const void *p, size_t n)
{
	if (send(fd, p, n, MSG_NOSIGNAL) != (ssize_t)n)
		die("send");
}

/* A request: "VERB ARG" (SUB/UNSUB and a pattern). */
static void
req(int fd, const char *verb, const char *arg)
{
	char b[512];
	int n = snprintf(b, sizeof b, "%s %s", verb, arg);
	put(fd, b, (size_t)n);
}

/* One round trip on fd, so every request sent on it before has been handled. */
static void
settle(int fd, long id)
{
	char k[64], m[80], r[512];
	ssize_t n;
	snprintf(k, sizeof k, "settle/%ld", id);
	req(fd, "SUB", k);
	int ml = snprintf(m, sizeof m, "MSG %s", k) + 1;
	put(fd, m, (size_t)ml);
	for (;;) {
		if ((n = recv(fd, r, sizeof r, 0)) <= 0)
			die("recv (settle)");
		if (n >= ml && !memcmp(r, m, (size_t)ml))
			break;
	}
	req(fd, "UNSUB", k);
}

/* A subscriber that will not be dropped to: blocking/soft/block, then its pattern. */
static int
subscriber(const char *path, const char *pattern, long id)
{
	int fd = dial(path);
	static const char blk[] = "CMSG blocking/soft/block";
	put(fd, blk, sizeof blk - 1);
	req(fd, "SUB", pattern);
	settle(fd, id);
	return fd;
}

static char *
message(const char *key, int size, size_t *len)
{
	size_t kl = strlen(key);
	size_t n = 4 + kl + 1 + (size_t)(size < 8 ? 8 : size);
	char *b = calloc(1, n);
	if (!b)
		die("calloc");
	memcpy(b, "MSG ", 4);
	memcpy(b + 4, key, kl);
	memset(b + 4 + kl + 1 + 8, 'p', n - (4 + kl + 1 + 8));
	*len = n;
	return b;
}

struct reader {
	int nfds;
	int *fds;
	uint64_t *next; /* next sequence number each subscriber expects */
	size_t off;     /* offset of the sequence number in a message */
	long got, want, bad;
	int warm; /* skip 'MSG bench/warmup' */
};

/* Read every subscriber until `want` messages arrived or STALL_S without progress. */
static double
read_all(struct reader *rd)
{
	struct epoll_event ev, evs[256];
	char *rb = malloc(RBUF);
	double last = mono();
	int ep = epoll_create1(EPOLL_CLOEXEC), i, n;
	if (ep < 0 || !rb)
		die("epoll_create1");
	for (i = 0; i < rd->nfds; i++) {
		ev.events = EPOLLIN;
		ev.data.u32 = (uint32_t)i;
		if (epoll_ctl(ep, EPOLL_CTL_ADD, rd->fds[i], &ev))
			die("epoll_ctl");
	}
	while (rd->got < rd->want) {
		n = epoll_wait(ep, evs, 256, 1000);
		if (n < 0 && errno != EINTR)
			die("epoll_wait");
		if (n <= 0) {
			if (mono() - last > STALL_S)
				break;
			continue;
		}
		for (i = 0; i < n; i++) {
			uint32_t s = evs[i].data.u32;
			for (;;) {
				ssize_t r = recv(rd->fds[s], rb, RBUF, MSG_DONTWAIT);
				uint64_t seq;
				if (r < 0)
					break;
				if (r == 0) {
					fprintf(stderr, "loadgen: the server closed subscriber %u\n", s);
					rd->want = rd->got;
					break;
				}
				if ((size_t)r < rd->off + 8 || memcmp(rb, "MSG bench/", 10))
					continue;
				if (rd->warm && r >= 16 && !memcmp(rb, "MSG bench/warmup", 16))
					continue;
				memcpy(&seq, rb + rd->off, 8);
				if (seq != rd->next[s])
					rd->bad++;
				rd->next[s] = seq + 1;
				rd->got++;
				last = mono();
			}
		}
	}
	close(ep);
	free(rb);
	return last;
}

static void
report(const char *head, struct reader *rd, long published, double t0, double t1, double cpu0, double cpu1)
{
	double dt = t1 - t0;
	if (dt <= 0)
		dt = 1e-9;
	printf("%s delivered=%ld/%ld wall=%.3f s published/s=%.0f delivered/s=%.0f",
	       head, rd->got, rd->want, dt, (double)published / dt, (double)rd->got / dt);
	if (cpu0 >= 0 && cpu1 >= 0)
		printf(" server_cpu_s=%.3f", cpu1 - cpu0);
	if (rd->bad)
		printf(" out_of_order=%ld", rd->bad);
	printf("\n");
	fflush(stdout);
}

/* Fork the publishing side: it writes its start time to the pipe, then runs `fn`. */
static pid_t
publish(int pp[2], void (*fn)(void *), void *arg)
{
	pid_t pid;
	if (pipe(pp))
		die("pipe");
	if ((pid = fork()) < 0)
		die("fork");
	if (!pid) {
		double t0;
		close(pp[0]);
		t0 = mono();
		if (write(pp[1], &t0, sizeof t0) != sizeof t0)
			_exit(2);
		fn(arg);
		_exit(0);
	}
	close(pp[1]);
	return pid;
}

struct pubjob {
	int npub, *fds;
	long msgs;
	char **bufs;
	size_t *lens, off;
};

static void
pub_run(void *arg)
{
	struct pubjob *j = arg;
	long m;
	int p;
	for (m = 0; m < j->msgs; m++)
		for (p = 0; p < j->npub; p++) {
			uint64_t seq = (uint64_t)m;
			memcpy(j->bufs[p] + j->off, &seq, 8);
			put(j->fds[p], j->bufs[p], j->lens[p]);
		}
}

static int
finish(const char *head, struct reader *rd, long published, int pp[2], pid_t pid, double cpu_start_unused)
{
	double t0, t1, c0, c1;
	long spid = server_pid();
	(void)cpu_start_unused;
	if (read(pp[0], &t0, sizeof t0) != sizeof t0)
		die("read (publisher start)");
	c0 = cpu_of(spid);
	t1 = read_all(rd);
	c1 = cpu_of(spid);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	report(head, rd, published, t0, t1, spid ? c0 : -1, spid ? c1 : -1);
	return rd->got == rd->want && !rd->bad ? 0 : 1;
}

/* Publish 'MSG bench/warmup' on pubfd until every subscriber of rd has one. */
static void
warm_up(int pubfd, struct reader *rd)
{
	static const char w[] = "MSG bench/warmup\0w";
	char rb[512];
	int s, *seen = calloc((size_t)rd->nfds, sizeof(int)), left = rd->nfds;
	double t0 = mono();
	rd->warm = 1;
	while (left) {
		if (mono() - t0 > STALL_S) {
			errno = ETIMEDOUT;
			die("no message crossed from SBUS_BENCH_PUBLISH_TO to SOCK");
		}
		put(pubfd, w, sizeof w - 1);
		usleep(50000);
		for (s = 0; s < rd->nfds; s++) {
			ssize_t r;
			while ((r = recv(rd->fds[s], rb, sizeof rb, MSG_DONTWAIT)) > 0)
				if (!seen[s] && r >= 16 && !memcmp(rb, w, 16)) {
					seen[s] = 1;
					left--;
				}
		}
	}
	free(seen);
}

static int
fanout(const char *path, int subs, long msgs, int size, int nclients, int npats)
{
	struct reader rd = {0};
	struct pubjob j = {0};
	char head[160];
	int c, p, pp[2], pubfd;
	size_t len;
	pid_t pid;
	for (c = 0; c < nclients; c++) {
		int fd = dial(path);
		char pat[96];
		for (p = 0; p < npats; p++) {
			snprintf(pat, sizeof pat, "bench/x/n%d_%d/", c, p);
			req(fd, "SUB", pat);
		}
		settle(fd, 1000000 + c);
		/* kept open, never read: they only hold patterns */
	}
	rd.nfds = subs;
	rd.fds = calloc((size_t)subs, sizeof(int));
	rd.next = calloc((size_t)subs, sizeof(uint64_t));
	for (c = 0; c < subs; c++)
		rd.fds[c] = subscriber(path, "bench/", c);
	rd.off = 4 + strlen("bench/x/y") + 1;
	rd.want = msgs * subs;
	pubfd = dial(getenv("SBUS_BENCH_PUBLISH_TO") ? getenv("SBUS_BENCH_PUBLISH_TO") : path);
	if (getenv("SBUS_BENCH_PUBLISH_TO"))
		warm_up(pubfd, &rd);
	j.npub = 1;
	j.fds = &pubfd;
	j.msgs = msgs;
	j.bufs = malloc(sizeof(char *));
	j.lens = &len;
	j.bufs[0] = message("bench/x/y", size, &len);
	j.off = rd.off;
	pid = publish(pp, pub_run, &j);
	snprintf(head, sizeof head, "fanout subs=%d msgs=%ld size=%d noise=%dx%d", subs, msgs, size, nclients, npats);
	return finish(head, &rd, msgs, pp, pid, 0);
}

static int
many(const char *path, int clients, int pubs, long msgs, int size)
{
	struct reader rd = {0};
	struct pubjob j = {0};
	char head[160], key[64];
	int c, pp[2];
	pid_t pid;
	if (pubs < 1 || clients < pubs || clients % pubs) {
		fprintf(stderr, "loadgen: many: CLIENTS must be a multiple of PUBLISHERS\n");
		return 2;
	}
	rd.nfds = clients;
	rd.fds = calloc((size_t)clients, sizeof(int));
	rd.next = calloc((size_t)clients, sizeof(uint64_t));
	for (c = 0; c < clients; c++) {
		snprintf(key, sizeof key, "bench/m/%04d", c % pubs);
		rd.fds[c] = subscriber(path, key, c);
	}
	rd.off = 4 + strlen("bench/m/0000") + 1;
	rd.want = msgs * clients;
	j.npub = pubs;
	j.fds = rd.fds;
	j.msgs = msgs;
	j.bufs = calloc((size_t)pubs, sizeof(char *));
	j.lens = calloc((size_t)pubs, sizeof(size_t));
	j.off = rd.off;
	for (c = 0; c < pubs; c++) {
		snprintf(key, sizeof key, "bench/m/%04d", c);
		j.bufs[c] = message(key, size, &j.lens[c]);
	}
	pid = publish(pp, pub_run, &j);
	snprintf(head, sizeof head, "many clients=%d publishers=%d per_key=%d msgs=%ld size=%d",
	         clients, pubs, clients / pubs, msgs, size);
	return finish(head, &rd, msgs * pubs, pp, pid, 0);
}


static int
rtt(const char *path, int rounds)
{
	static const char ping[] = "MSG ping\0x";
	char rb[256];
	double *t = malloc((size_t)rounds * sizeof(double)), t0;
	int fd = dial(path), i;
	req(fd, "SUB", "ping");
	settle(fd, 0);
	for (i = -200; i < rounds; i++) {
		t0 = mono();
		put(fd, ping, sizeof ping - 1);
		if (recv(fd, rb, sizeof rb, 0) <= 0)
			die("recv (rtt)");
		if (i >= 0)
			t[i] = (mono() - t0) * 1e6;
	}
	qsort(t, (size_t)rounds, sizeof(double), cmpd);
	printf("rtt rounds=%d median_us=%.1f p99_us=%.1f\n", rounds, t[rounds / 2], t[(long)rounds * 99 / 100]);
	return 0;
}

int
main(int argc, char **argv)
{
	if (argc == 8 && !strcmp(argv[1], "fanout"))
		return fanout(argv[2], atoi(argv[3]), atol(argv[4]), atoi(argv[5]), atoi(argv[6]), atoi(argv[7]));
	if (argc == 7 && !strcmp(argv[1], "many"))
		return many(argv[2], atoi(argv[3]), atoi(argv[4]), atol(argv[5]), atoi(argv[6]));
	if (argc == 4 && !strcmp(argv[1], "rtt"))
		return rtt(argv[2], atoi(argv[3]));
	fprintf(stderr, "usage: loadgen fanout SOCK SUBS MSGS SIZE NOISE_CLIENTS NOISE_PATTERNS\n"
	                "       loadgen many SOCK CLIENTS PUBLISHERS MSGS SIZE\n"
	                "       loadgen rtt SOCK ROUNDS\n");
	return 2;
}
