/* loadgen_peers: the load generator for the peers of bench/peers.py. It speaks
 * the minimal subset of three stream protocols over TCP or a unix stream socket:
 *
 *   nats  NATS text protocol: INFO, CONNECT, PING/PONG, SUB, PUB, MSG
 *   resp  Redis (RESP2): PING, SUBSCRIBE, PUBLISH, the 'message' push
 *   mqtt  MQTT 3.1.1: CONNECT/CONNACK, SUBSCRIBE/SUBACK, PUBLISH at QoS 0
 *
 * and runs the scenarios bench/loadgen.c runs against sbus, printing the same
 * lines, so bench/peers.py reads both alike:
 *
 *   loadgen_peers PROTO ADDR fanout SUBS MSGS SIZE
 *       SUBS subscribers each hold 'bench/x/y' (NATS: 'bench.x.y'); one
 *       publisher (a forked process) sends MSGS messages of SIZE bytes on it.
 *   loadgen_peers PROTO ADDR many CLIENTS PUBLISHERS MSGS SIZE
 *       CLIENTS subscribers, subscriber i holds 'bench/m/<i mod PUBLISHERS>';
 *       PUBLISHERS more connections (a forked process) each send MSGS
 *       messages on their own key, round robin.
 *   loadgen_peers PROTO ADDR rtt ROUNDS
 *       one connection subscribes 'ping', another publishes on it and waits
 *       until the first has the message (200 rounds of warm-up first).
 *   loadgen_peers PROTO ADDR memory CLIENTS SUBS_EACH
 *       for bench/peers.py's memory rows: prints 'step base' after one
 *       connection made its handshake, 'step conns' after CLIENTS more did,
 *       'step subs' after each of them holds SUBS_EACH distinct subjects
 *       (every subscription confirmed), reading a line from stdin before each
 *       next step and exiting at end of stdin.
 *
 * ADDR is tcp:HOST:PORT (IPv4) or unix:PATH. Subjects are exact (no
 * wildcards). Publishers write in batches of up to BATCH bytes, as the
 * protocols' buffered clients do (the stream carries many messages per write);
 * LOADGEN_PEERS_BATCH=0 writes each message with a system call of its own.
 * Payloads carry a sequence number: every subscriber checks it receives each
 * message once and in order. fanout/many print
 *   ... delivered=GOT/WANT wall=S s published/s=N delivered/s=N [server_cpu_s=S]
 * and exit 0 when every message arrived in order, 1 when some were lost
 * (a subscriber was closed by the server, or STALL_S s without progress) or
 * reordered, 2 on a setup failure (one line on stderr). With
 * SBUS_BENCH_SERVER_PID set, the server's utime + stime over the publishing
 * phase is added as server_cpu_s. rtt prints median_us and p99_us.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
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

#define STALL_S 10.0
#define BATCH (32 * 1024) /* default; LOADGEN_PEERS_BATCH=BYTES changes it (0: one message per write) */
#define CBUF (64 * 1024)

enum proto { NATS, RESP, MQTT };
enum kind { K_NONE, K_MSG, K_SYNC, K_PING, K_ERR, K_OTHER };

static enum proto P;
static const char *ADDR;

static void
fail(const char *what)
{
	fprintf(stderr, "loadgen_peers: %s%s%s\n", what, errno ? ": " : "", errno ? strerror(errno) : "");
	exit(2);
}



/* ---------------------------------------------------------------- connections */

struct conn {
	int fd;
	char *buf;
	size_t len, cap;
	uint64_t next; /* next sequence number expected */
	int closed;
};

static int
dial(void)
{
	int fd, one = 1;
	errno = 0;
	if (!strncmp(ADDR, "unix:", 5)) {
		struct sockaddr_un a;
		memset(&a, 0, sizeof a);
		a.sun_family = AF_UNIX;
		if (strlen(ADDR + 5) >= sizeof a.sun_path)
			fail("unix: path too long");
		strcpy(a.sun_path, ADDR + 5);
		if ((fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
		    connect(fd, (struct sockaddr *)&a, sizeof a))
			fail("connect");
		return fd;
	}
	if (!strncmp(ADDR, "tcp:", 4)) {
		struct sockaddr_in a;
		char host[64];
		const char *colon = strrchr(ADDR + 4, ':');
		size_t hl = colon ? (size_t)(colon - (ADDR + 4)) : 0;
		memset(&a, 0, sizeof a);
		a.sin_family = AF_INET;
		if (!colon || hl >= sizeof host || atoi(colon + 1) <= 0)
			fail("ADDR must be tcp:HOST:PORT or unix:PATH");
		memcpy(host, ADDR + 4, hl);
		host[hl] = 0;
		if (inet_pton(AF_INET, host, &a.sin_addr) != 1)
			fail("tcp: HOST must be an IPv4 address");
		a.sin_port = htons((uint16_t)atoi(colon + 1));
		if ((fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)) < 0 ||
		    connect(fd, (struct sockaddr *)&a, sizeof a))
			fail("connect");
		setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
		return fd;
	}
	fail("ADDR must be tcp:HOST:PORT or unix:PATH");
	return -1;
}

static void
put(int fd, const void *p, size_t n)
{
	const char *b = p;
	while (n) {
		ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			fail("send");
		b += w;
		n -= (size_t)w;
	}
}

/* Discard whatever the server sent a publisher (Redis's counts). */
static void
drain(int fd)
{
	char b[16384];
	while (recv(fd, b, sizeof b, MSG_DONTWAIT) > 0)
		;
}

/* ---------------------------------------------------------------- encoding */

/* The subject for a key given with '/' separators (NATS uses '.'). */
static void
subject(char *out, size_t n, const char *key)
{
	snprintf(out, n, "%s", key);
	if (P == NATS)
		for (; *out; out++)
			if (*out == '/')
				*out = '.';
}

static size_t
mqtt_len(char *o, size_t n)
{
	size_t i = 0;
	do {
		unsigned char d = n % 128;
		n /= 128;
		o[i++] = (char)(d | (n ? 128 : 0));
	} while (n);
	return i;
}

static size_t
mqtt_str(char *o, const char *s, size_t n)
{
	o[0] = (char)(n >> 8);
	o[1] = (char)(n & 255);
	memcpy(o + 2, s, n);
	return n + 2;
}

static size_t
enc_sub(char *o, const char *subj, int sid)
{
	size_t sl = strlen(subj), i;
	char body[600];
	switch (P) {
	case NATS:
		return (size_t)sprintf(o, "SUB %s %d\r\n", subj, sid);
	case RESP:
		return (size_t)sprintf(o, "*2\r\n$9\r\nSUBSCRIBE\r\n$%zu\r\n%s\r\n", sl, subj);
	case MQTT:
		body[0] = (char)((sid >> 8) & 255);
		body[1] = (char)((sid & 255) | (sid & 0xffff ? 0 : 1)); /* packet id 0 is not allowed */
		i = 2 + mqtt_str(body + 2, subj, sl);
		body[i++] = 0; /* QoS 0 */
		o[0] = (char)0x82;
		sl = 1 + mqtt_len(o + 1, i);
		memcpy(o + sl, body, i);
		return sl + i;
	}
	return 0;
}

/* A publish of `n` payload bytes; the payload goes at *poff. */
static size_t
enc_pub(char *o, const char *subj, size_t n, size_t *poff)
{
	size_t sl = strlen(subj), h;
	switch (P) {
	case NATS:
		h = (size_t)sprintf(o, "PUB %s %zu\r\n", subj, n);
		*poff = h;
		memcpy(o + h + n, "\r\n", 2);
		return h + n + 2;
	case RESP:
		h = (size_t)sprintf(o, "*3\r\n$7\r\nPUBLISH\r\n$%zu\r\n%s\r\n$%zu\r\n", sl, subj, n);
		*poff = h;
		memcpy(o + h + n, "\r\n", 2);
		return h + n + 2;
	case MQTT:
		o[0] = 0x30;
		h = 1 + mqtt_len(o + 1, 2 + sl + n);
		h += mqtt_str(o + h, subj, sl);
		*poff = h;
		return h + n;
	}
	return 0;
}

/* The handshake: the request that opens a session and whose answer (K_SYNC) proves it open. */
static size_t
enc_hello(char *o, long id)
{
	char cid[64];
	size_t i, n;
	switch (P) {
	case NATS:
		return (size_t)sprintf(o, "CONNECT {\"verbose\":false,\"pedantic\":false,\"echo\":true}\r\nPING\r\n");
	case RESP:
		return (size_t)sprintf(o, "*1\r\n$4\r\nPING\r\n");
	case MQTT: {
		static const char vh[] = {0, 4, 'M', 'Q', 'T', 'T', 4, 2, 0, 0}; /* clean session, no keep-alive */
		char body[128];
		n = (size_t)snprintf(cid, sizeof cid, "lg%ld-%ld", (long)getpid(), id);
		memcpy(body, vh, sizeof vh);
		i = sizeof vh + mqtt_str(body + sizeof vh, cid, n);
		o[0] = 0x10;
		n = 1 + mqtt_len(o + 1, i);
		memcpy(o + n, body, i);
		return n + i;
	}
	}
	return 0;
}

/* How many K_SYNC answers prove that k subscriptions sent together are in place. */
static long
syncs_for_subs(long k)
{
	return P == NATS ? 1 : k; /* NATS: one PING after them; RESP: a confirmation each; MQTT: a SUBACK each */
}

/* ---------------------------------------------------------------- parsing */

static const char *
crlf(const char *b, size_t n)
{
	const char *p = memchr(b, '\n', n);
	return p && p > b && p[-1] == '\r' ? p - 1 : (p ? p : NULL);
}

/* One RESP value at b: its end, or NULL if incomplete; a bulk string's data in *s, *sl. */
static const char *
resp_value(const char *b, const char *end, const char **s, size_t *sl)
{
	const char *e = crlf(b, (size_t)(end - b));
	long n;
	if (!e)
		return NULL;
	*s = b + 1;
	*sl = (size_t)(e - b - 1);
	if (*b != '$')
		return e + 2;
	n = atol(b + 1);
	if (n < 0)
		return e + 2;
	if (end - (e + 2) < n + 2)
		return NULL;
	*s = e + 2;
	*sl = (size_t)n;
	return e + 2 + n + 2;
}

/* One frame at the start of c's buffer: its length (0 if incomplete), its kind and a message's payload. */
static size_t
frame(struct conn *c, enum kind *k, const char **pl, size_t *pn)
{
	const char *b = c->buf, *end = c->buf + c->len, *e, *s;
	size_t n = c->len, sl;
	*k = K_OTHER;
	if (!n)
		return 0;
	if (P == NATS) {
		if (!(e = crlf(b, n)))
			return 0;
		if (n >= 4 && !memcmp(b, "MSG ", 4)) {
			const char *sp = e;
			long bytes;
			while (sp > b && sp[-1] != ' ')
				sp--;
			bytes = atol(sp);
			if ((size_t)(end - (e + 2)) < (size_t)bytes + 2)
				return 0;
			*k = K_MSG;
			*pl = e + 2;
			*pn = (size_t)bytes;
			return (size_t)(e + 2 + bytes + 2 - b);
		}
		if (!memcmp(b, "PING", 4))
			*k = K_PING;
		else if (!memcmp(b, "PONG", 4))
			*k = K_SYNC;
		else if (*b == '-')
			*k = K_ERR;
		return (size_t)(e + 2 - b);
	}
	if (P == RESP) {
		const char *first = NULL;
		size_t fl = 0;
		long i, cnt;
		if (*b != '*') {
			if (!(e = crlf(b, n)))
				return 0;
			*k = *b == '-' ? K_ERR : (!memcmp(b, "+PONG", 5) ? K_SYNC : K_OTHER);
			return (size_t)(e + 2 - b);
		}
		if (!(e = crlf(b, n)))
			return 0;
		cnt = atol(b + 1);
		for (i = 0, b = e + 2; i < cnt; i++) {
			if (b >= end || !(b = resp_value(b, end, &s, &sl)))
				return 0;
			if (i == 0) {
				first = s;
				fl = sl;
			}
			if (i == 2) {
				*pl = s;
				*pn = sl;
			}
		}
		if (first && fl == 7 && !memcmp(first, "message", 7) && cnt == 3)
			*k = K_MSG;
		else if (first && ((fl == 9 && !memcmp(first, "subscribe", 9)) || (fl == 4 && !memcmp(first, "pong", 4))))
			*k = K_SYNC;
		return (size_t)(b - c->buf);
	}
	{ /* MQTT */
		size_t rl = 0, i = 1, mul = 1, tl;
		unsigned char h = (unsigned char)b[0], d;
		do {
			if (i >= n)
				return 0;
			d = (unsigned char)b[i++];
			rl += (d & 127) * mul;
			mul *= 128;
		} while ((d & 128) && i < 5);
		if (n - i < rl)
			return 0;
		switch (h >> 4) {
		case 2: /* CONNACK */
			*k = rl >= 2 && b[i + 1] == 0 ? K_SYNC : K_ERR;
			break;
		case 9: /* SUBACK */
			*k = rl >= 3 && (unsigned char)b[i + 2] == 0x80 ? K_ERR : K_SYNC;
			break;
		case 3: /* PUBLISH */
			tl = ((size_t)(unsigned char)b[i] << 8) | (unsigned char)b[i + 1];
			*pl = b + i + 2 + tl + (((h >> 1) & 3) ? 2 : 0);
			*pn = (size_t)(b + i + rl - *pl);
			*k = K_MSG;
			break;
		}
		return i + rl;
	}
}

/* Read what is there (or wait for it when `block`); 0 on end of stream. */
static int
fill(struct conn *c, int block)
{
	ssize_t r;
	if (c->cap - c->len < 4096) {
		c->cap *= 2;
		if (!(c->buf = realloc(c->buf, c->cap)))
			fail("realloc");
	}
	r = recv(c->fd, c->buf + c->len, c->cap - c->len, block ? 0 : MSG_DONTWAIT);
	if (r == 0)
		return 0;
	if (r < 0)
		return errno == EAGAIN || errno == EINTR ? -1 : 0;
	c->len += (size_t)r;
	return 1;
}

static void
consume(struct conn *c, size_t n)
{
	memmove(c->buf, c->buf + n, c->len - n);
	c->len -= n;
}

static void
pong(struct conn *c)
{
	put(c->fd, "PONG\r\n", 6);
}

/* Block until `want` K_SYNC answers arrived on c (messages are skipped). */
static void
await_sync(struct conn *c, long want)
{
	enum kind k;
	const char *pl;
	size_t pn, n;
	while (want > 0) {
		while ((n = frame(c, &k, &pl, &pn))) {
			if (k == K_SYNC)
				want--;
			else if (k == K_PING)
				pong(c);
			else if (k == K_ERR) {
				errno = 0;
				fprintf(stderr, "loadgen_peers: the server answered an error: %.*s\n",
				        (int)(c->len < 200 ? c->len : 200), c->buf);
				exit(2);
			}
			consume(c, n);
		}
		if (want > 0 && fill(c, 1) == 0) {
			errno = 0;
			fail("the server closed a connection during set-up");
		}
	}
}

static struct conn *
open_conn(long id)
{
	struct conn *c = calloc(1, sizeof *c);
	char o[256];
	if (!c || !(c->buf = malloc(CBUF)))
		fail("malloc");
	c->cap = CBUF;
	c->fd = dial();
	if (P == NATS) { /* the server speaks first: INFO */
		while (!memchr(c->buf, '\n', c->len))
			if (fill(c, 1) == 0) {
				errno = 0;
				fail("the server closed the connection before INFO");
			}
		consume(c, (size_t)((char *)memchr(c->buf, '\n', c->len) - c->buf) + 1);
	}
	put(c->fd, o, enc_hello(o, id));
	await_sync(c, 1);
	return c;
}

/* Subscribe c to the k subjects of keys[] and wait until the server confirmed them. */
static void
subscribe(struct conn *c, char **keys, long k)
{
	char o[1024], subj[512];
	long i;
	for (i = 0; i < k; i++) {
		subject(subj, sizeof subj, keys[i]);
		put(c->fd, o, enc_sub(o, subj, (int)(i + 1)));
	}
	if (P == NATS)
		put(c->fd, "PING\r\n", 6);
	await_sync(c, syncs_for_subs(k));
}

/* ---------------------------------------------------------------- throughput */

struct pubjob {
	int npub;
	struct conn **c;
	long msgs;
	size_t size;
	char **subj;
};

static void
pub_run(struct pubjob *j)
{
	char **out = calloc((size_t)j->npub, sizeof(char *));
	size_t *ol = calloc((size_t)j->npub, sizeof(size_t)), poff;
	long m;
	int p;
	const char *env = getenv("LOADGEN_PEERS_BATCH");
	size_t batch = env ? (size_t)atol(env) : BATCH;
	for (p = 0; p < j->npub; p++)
		if (!(out[p] = malloc(batch + j->size + 1024)))
			fail("malloc");
	for (m = 0; m < j->msgs; m++)
		for (p = 0; p < j->npub; p++) {
			uint64_t seq = (uint64_t)m;
			size_t n = enc_pub(out[p] + ol[p], j->subj[p], j->size, &poff);
			memcpy(out[p] + ol[p] + poff, &seq, 8);
			memset(out[p] + ol[p] + poff + 8, 'p', j->size - 8);
			ol[p] += n;
			if (ol[p] >= batch) {
				put(j->c[p]->fd, out[p], ol[p]);
				ol[p] = 0;
				drain(j->c[p]->fd);
			}
		}
	for (p = 0; p < j->npub; p++)
		if (ol[p])
			put(j->c[p]->fd, out[p], ol[p]);
	/* stay until killed: closing could make a server drop what it has not forwarded yet */
	for (;;)
		for (p = 0; p < j->npub; p++) {
			drain(j->c[p]->fd);
			usleep(10000);
		}
}

struct reader {
	int n;
	struct conn **c;
	long got, want, bad, closed;
};

static double
read_all(struct reader *rd)
{
	struct epoll_event ev, evs[256];
	double last = mono();
	int ep = epoll_create1(EPOLL_CLOEXEC), i, n;
	if (ep < 0)
		fail("epoll_create1");
	for (i = 0; i < rd->n; i++) {
		ev.events = EPOLLIN;
		ev.data.u32 = (uint32_t)i;
		if (epoll_ctl(ep, EPOLL_CTL_ADD, rd->c[i]->fd, &ev))
			fail("epoll_ctl");
	}
	while (rd->got < rd->want && rd->closed < rd->n) {
		n = epoll_wait(ep, evs, 256, 1000);
		if (n < 0 && errno != EINTR)
			fail("epoll_wait");
		if (n <= 0) {
			if (mono() - last > STALL_S)
				break;
			continue;
		}
		for (i = 0; i < n; i++) {
			struct conn *c = rd->c[evs[i].data.u32];
			int r;
			while ((r = fill(c, 0)) > 0) {
				enum kind k;
				const char *pl;
				size_t pn, fl, off = 0;
				uint64_t seq;
				for (;;) {
					struct conn view = *c;
					view.buf = c->buf + off;
					view.len = c->len - off;
					if (!(fl = frame(&view, &k, &pl, &pn)))
						break;
					off += fl;
					if (k == K_PING)
						pong(c);
					else if (k == K_ERR)
						fprintf(stderr, "loadgen_peers: subscriber %u: server error: %.*s\n",
						        evs[i].data.u32, (int)(fl < 120 ? fl : 120), view.buf);
					if (k != K_MSG || pn < 8)
						continue;
					memcpy(&seq, pl, 8);
					if (seq != c->next)
						rd->bad++;
					c->next = seq + 1;
					rd->got++;
				}
				consume(c, off);
				last = mono();
			}
			if (r == 0 && !c->closed) {
				c->closed = 1;
				rd->closed++;
				epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
				fprintf(stderr, "loadgen_peers: the server closed subscriber %u\n", evs[i].data.u32);
			}
		}
	}
	close(ep);
	return last;
}

static int
run(const char *head, struct reader *rd, struct pubjob *j, long published)
{
	int pp[2];
	pid_t pid;
	double t0, t1, c0, c1, dt;
	const char *s = getenv("SBUS_BENCH_SERVER_PID");
	long spid = s ? atol(s) : 0;
	if (pipe(pp))
		fail("pipe");
	if ((pid = fork()) < 0)
		fail("fork");
	if (!pid) {
		close(pp[0]);
		t0 = mono();
		if (write(pp[1], &t0, sizeof t0) != sizeof t0)
			_exit(2);
		pub_run(j);
		_exit(0);
	}
	close(pp[1]);
	if (read(pp[0], &t0, sizeof t0) != sizeof t0)
		fail("read (publisher start)");
	c0 = cpu_of(spid);
	t1 = read_all(rd);
	c1 = cpu_of(spid);
	kill(pid, SIGKILL);
	waitpid(pid, NULL, 0);
	dt = t1 - t0 > 0 ? t1 - t0 : 1e-9;
	printf("%s delivered=%ld/%ld wall=%.3f s published/s=%.0f delivered/s=%.0f", head, rd->got, rd->want, dt,
	       (double)published / dt, (double)rd->got / dt);
	if (spid && c0 >= 0 && c1 >= 0)
		printf(" server_cpu_s=%.3f", c1 - c0);
	if (rd->bad)
		printf(" out_of_order=%ld", rd->bad);
	printf("\n");
	fflush(stdout);
	return rd->got == rd->want && !rd->bad ? 0 : 1;
}

static int
fanout(int subs, long msgs, int size)
{
	struct reader rd = {0};
	struct pubjob j = {0};
	char head[160], subj[64], *key = "bench/x/y";
	struct conn *pub;
	int i;
	rd.n = subs;
	rd.c = calloc((size_t)subs, sizeof *rd.c);
	for (i = 0; i < subs; i++) {
		rd.c[i] = open_conn(i);
		subscribe(rd.c[i], &key, 1);
	}
	rd.want = msgs * subs;
	pub = open_conn(subs);
	subject(subj, sizeof subj, key);
	j.npub = 1;
	j.c = &pub;
	j.msgs = msgs;
	j.size = (size_t)size;
	j.subj = malloc(sizeof(char *));
	j.subj[0] = subj;
	snprintf(head, sizeof head, "fanout subs=%d msgs=%ld size=%d", subs, msgs, size);
	return run(head, &rd, &j, msgs);
}

static int
many(int clients, int pubs, long msgs, int size)
{
	struct reader rd = {0};
	struct pubjob j = {0};
	char head[160], key[64];
	int i;
	if (pubs < 1 || clients < pubs || clients % pubs) {
		errno = 0;
		fail("many: CLIENTS must be a multiple of PUBLISHERS");
	}
	rd.n = clients;
	rd.c = calloc((size_t)clients, sizeof *rd.c);
	for (i = 0; i < clients; i++) {
		char *k = key;
		snprintf(key, sizeof key, "bench/m/%04d", i % pubs);
		rd.c[i] = open_conn(i);
		subscribe(rd.c[i], &k, 1);
	}
	rd.want = msgs * clients;
	j.npub = pubs;
	j.c = calloc((size_t)pubs, sizeof *j.c);
	j.subj = calloc((size_t)pubs, sizeof(char *));
	j.msgs = msgs;
	j.size = (size_t)size;
	for (i = 0; i < pubs; i++) {
		j.c[i] = open_conn(clients + i);
		snprintf(key, sizeof key, "bench/m/%04d", i);
		j.subj[i] = malloc(64);
		subject(j.subj[i], 64, key);
	}
	snprintf(head, sizeof head, "many clients=%d publishers=%d per_key=%d msgs=%ld size=%d", clients, pubs,
	         clients / pubs, msgs, size);
	return run(head, &rd, &j, msgs * pubs);
}


static int
rtt(int rounds)
{
	char *key = "ping", o[256], subj[16];
	double *t = malloc((size_t)rounds * sizeof(double)), t0;
	struct conn *s = open_conn(0), *p = open_conn(1);
	size_t n, poff;
	int i;
	subscribe(s, &key, 1);
	subject(subj, sizeof subj, key);
	n = enc_pub(o, subj, 8, &poff);
	memset(o + poff, 'x', 8);
	for (i = -200; i < rounds; i++) {
		enum kind k = K_NONE;
		const char *pl;
		size_t pn, fl;
		t0 = mono();
		put(p->fd, o, n);
		while (k != K_MSG) {
			while ((fl = frame(s, &k, &pl, &pn))) {
				consume(s, fl);
				if (k == K_MSG)
					break;
				if (k == K_PING)
					pong(s);
			}
			if (k != K_MSG && fill(s, 1) == 0) {
				errno = 0;
				fail("the server closed the subscriber (rtt)");
			}
		}
		if (i >= 0)
			t[i] = (mono() - t0) * 1e6;
		drain(p->fd);
	}
	qsort(t, (size_t)rounds, sizeof(double), cmpd);
	printf("rtt rounds=%d median_us=%.1f p99_us=%.1f\n", rounds, t[rounds / 2], t[(long)rounds * 99 / 100]);
	return 0;
}

static void
step(const char *name)
{
	char line[64];
	printf("step %s\n", name);
	fflush(stdout);
	if (!fgets(line, sizeof line, stdin))
		exit(0);
}

static int
memory(int clients, int each)
{
	struct conn **c = calloc((size_t)clients, sizeof *c);
	char **keys = calloc((size_t)each, sizeof(char *));
	int i, k;
	open_conn(-1);
	step("base");
	for (i = 0; i < clients; i++)
		c[i] = open_conn(i);
	step("conns");
	for (k = 0; k < each; k++)
		keys[k] = malloc(64);
	for (i = 0; i < clients; i++) {
		for (k = 0; k < each; k++)
			snprintf(keys[k], 64, "bench/x/n%d_%d", i, k);
		subscribe(c[i], keys, each);
	}
	step("subs");
	return 0;
}

static long
num(const char *s, long min)
{
	char *e;
	long v = strtol(s, &e, 10);
	if (!*s || *e || v < min) {
		errno = 0;
		fprintf(stderr, "loadgen_peers: '%s' is not a whole number >= %ld\n", s, min);
		exit(2);
	}
	return v;
}

int
main(int argc, char **argv)
{
	if (argc >= 4) {
		if (!strcmp(argv[1], "nats"))
			P = NATS;
		else if (!strcmp(argv[1], "resp"))
			P = RESP;
		else if (!strcmp(argv[1], "mqtt"))
			P = MQTT;
		else {
			fprintf(stderr, "loadgen_peers: unknown protocol '%s' (nats, resp, mqtt)\n", argv[1]);
			return 2;
		}
		ADDR = argv[2];
		signal(SIGPIPE, SIG_IGN);
		if (argc == 7 && !strcmp(argv[3], "fanout"))
			return fanout((int)num(argv[4], 1), num(argv[5], 1), (int)num(argv[6], 8));
		if (argc == 8 && !strcmp(argv[3], "many"))
			return many((int)num(argv[4], 1), (int)num(argv[5], 1), num(argv[6], 1), (int)num(argv[7], 8));
		if (argc == 5 && !strcmp(argv[3], "rtt"))
			return rtt((int)num(argv[4], 1));
		if (argc == 6 && !strcmp(argv[3], "memory"))
			return memory((int)num(argv[4], 1), (int)num(argv[5], 0));
	}
	fprintf(stderr, "usage: loadgen_peers nats|resp|mqtt ADDR fanout SUBS MSGS SIZE\n"
	                "       loadgen_peers nats|resp|mqtt ADDR many CLIENTS PUBLISHERS MSGS SIZE\n"
	                "       loadgen_peers nats|resp|mqtt ADDR rtt ROUNDS\n"
	                "       loadgen_peers nats|resp|mqtt ADDR memory CLIENTS SUBS_EACH\n"
	                "ADDR: tcp:HOST:PORT or unix:PATH\n");
	return 2;
}
