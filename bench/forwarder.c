/* forwarder: the floor of what any sbus server must do per message, for
 * bench/run.py to compare servers against in the same run.
 *
 *   forwarder SOCK
 *
 * Single-threaded, epoll, level-triggered: one recv per readable client per
 * wakeup, then one blocking send (MSG_NOSIGNAL) per subscriber whose pattern
 * matches. Matching is the minimum the benchmarks need: a pattern ending in
 * '/' matches keys that start with it, any other pattern matches its exact
 * key; no '*', no secrets, no flood control, control messages ignored. UNSUB
 * removes one instance. Clients are scanned linearly. Runs until killed.
 *
 *   forwarder -b SOCK
 *
 * The batched floor (issue 25's "C forwarder with recvmmsg/sendmmsg"): one
 * recvmmsg of up to 64 packets per readable client per wakeup, then one
 * blocking sendmmsg per subscriber of everything the batch matched for it,
 * in order: what a server that batches like ours costs without Python.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define MAXPKT 409600

struct pat {
	char *s;
	size_t n;
};

#define BATCH 64

struct client {
	int fd, npats, cap;
	struct pat *pats;
	int npend; /* -b: packets of the current batch waiting for this subscriber */
	struct mmsghdr *pend; /* BATCH each, -b only */
	struct iovec *piov;
};

static struct client **clients; /* by fd */
static int *subs, nsubs;        /* fds holding at least one pattern */
static int maxfd;

static void
drop_sub(int fd)
{
	for (int j = 0; j < nsubs; j++)
		if (subs[j] == fd) {
			subs[j] = subs[--nsubs];
			return;
		}
}

static void
gone(int ep, int fd)
{
	struct client *c = clients[fd];
	epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
	close(fd);
	if (!c)
		return;
	if (c->npats)
		drop_sub(fd);
	for (int i = 0; i < c->npats; i++)
		free(c->pats[i].s);
	free(c->pats);
	free(c->pend);
	free(c->piov);
	free(c);
	clients[fd] = NULL;
}

static int
matches(const struct pat *p, const char *key, size_t kl)
{
	if (p->n && p->s[p->n - 1] == '/')
		return kl >= p->n && !memcmp(key, p->s, p->n);
	return kl == p->n && !memcmp(key, p->s, kl);
}

/* -b: one batch from `fd`; returns 0 when the client is gone. */
static char *bbuf[BATCH];
static struct mmsghdr rmsg[BATCH];
static struct iovec riov[BATCH];
static int dirty[1 << 16], ndirty, batched;

static void
handle(struct client *from, char *buf, size_t r)
{
	buf[r] = 0;
	if (r >= 4 && !memcmp(buf, "MSG ", 4)) {
		size_t kl = strlen(buf + 4);
		for (int j = 0; j < nsubs; j++) {
			struct client *c = clients[subs[j]];
			for (int k = 0; k < c->npats; k++)
				if (matches(&c->pats[k], buf + 4, kl)) {
					if (!batched) {
						send(c->fd, buf, r, MSG_NOSIGNAL);
						break;
					}
					if (!c->npend)
						dirty[ndirty++] = c->fd;
					c->piov[c->npend].iov_base = buf;
					c->piov[c->npend].iov_len = r;
					memset(&c->pend[c->npend].msg_hdr, 0, sizeof c->pend[0].msg_hdr);
					c->pend[c->npend].msg_hdr.msg_iov = &c->piov[c->npend];
					c->pend[c->npend].msg_hdr.msg_iovlen = 1;
					c->npend++;
					break;
				}
		}
	} else if (r >= 4 && !memcmp(buf, "SUB ", 4)) {
		struct client *c = from;
		if (c->npats == c->cap) {
			c->cap = c->cap ? 2 * c->cap : 4;
			c->pats = realloc(c->pats, (size_t)c->cap * sizeof *c->pats);
		}
		c->pats[c->npats].s = strdup(buf + 4);
		c->pats[c->npats].n = strlen(buf + 4);
		if (!c->npats++)
			subs[nsubs++] = c->fd;
	} else if (r >= 6 && !memcmp(buf, "UNSUB ", 6)) {
		struct client *c = from;
		for (int k = 0; k < c->npats; k++)
			if (!strcmp(c->pats[k].s, buf + 6)) {
				free(c->pats[k].s);
				c->pats[k] = c->pats[--c->npats];
				if (!c->npats)
					drop_sub(c->fd);
				break;
			}
	}
}

static int
batch(int fd)
{
	int n = recvmmsg(fd, rmsg, BATCH, MSG_DONTWAIT, NULL);
	if (n <= 0)
		return n < 0 && (errno == EAGAIN || errno == EINTR);
	for (int i = 0; i < n; i++) {
		size_t r = rmsg[i].msg_len;
		if (!r || r > MAXPKT || (rmsg[i].msg_hdr.msg_flags & MSG_TRUNC))
			return 0;
		handle(clients[fd], bbuf[i], r);
	}
	for (int d = 0; d < ndirty; d++) {
		struct client *c = clients[dirty[d]];
		int sent = 0;
		while (c && sent < c->npend) {
			int m = sendmmsg(c->fd, c->pend + sent, (unsigned)(c->npend - sent), MSG_NOSIGNAL);
			if (m <= 0)
				break;
			sent += m;
		}
		if (c)
			c->npend = 0;
	}
	ndirty = 0;
	return 1;
}

int
main(int argc, char **argv)
{
	struct sockaddr_un a;
	struct epoll_event ev, evs[64];
	char *buf = malloc(MAXPKT + 1);
	int srv, ep, n, i;
	if (argc == 3 && !strcmp(argv[1], "-b")) {
		batched = 1;
		argv++;
		argc--;
		for (i = 0; i < BATCH; i++) {
			bbuf[i] = malloc(MAXPKT + 1);
			riov[i].iov_base = bbuf[i];
			riov[i].iov_len = MAXPKT + 1;
			rmsg[i].msg_hdr.msg_iov = &riov[i];
			rmsg[i].msg_hdr.msg_iovlen = 1;
			if (!bbuf[i])
				return 2;
		}
	}
	if (argc != 2) {
		fprintf(stderr, "usage: forwarder [-b] SOCK\n");
		return 2;
	}
	maxfd = 1 << 16;
	clients = calloc((size_t)maxfd, sizeof *clients);
	subs = calloc((size_t)maxfd, sizeof *subs);
	srv = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	memset(&a, 0, sizeof a);
	a.sun_family = AF_UNIX;
	strncpy(a.sun_path, argv[1], sizeof a.sun_path - 1);
	if (srv < 0 || !buf || !clients || !subs || bind(srv, (struct sockaddr *)&a, sizeof a) ||
	    listen(srv, SOMAXCONN)) {
		fprintf(stderr, "forwarder: %s: %s\n", argv[1], strerror(errno));
		return 2;
	}
	ep = epoll_create1(EPOLL_CLOEXEC);
	ev.events = EPOLLIN;
	ev.data.fd = srv;
	epoll_ctl(ep, EPOLL_CTL_ADD, srv, &ev);
	for (;;) {
		n = epoll_wait(ep, evs, 64, -1);
		for (i = 0; i < n; i++) {
			int fd = evs[i].data.fd;
			ssize_t r;
			if (fd == srv) {
				int c = accept4(srv, NULL, NULL, SOCK_CLOEXEC);
				if (c < 0)
					continue;
				if (c >= maxfd || !(clients[c] = calloc(1, sizeof(struct client)))) {
					close(c);
					continue;
				}
				clients[c]->fd = c;
				if (batched && (!(clients[c]->pend = calloc(BATCH, sizeof(struct mmsghdr))) ||
				                !(clients[c]->piov = calloc(BATCH, sizeof(struct iovec))))) {
					gone(ep, c);
					continue;
				}
				ev.events = EPOLLIN;
				ev.data.fd = c;
				epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev);
				continue;
			}
			if (batched) {
				if (!batch(fd))
					gone(ep, fd);
				continue;
			}
			r = recv(fd, buf, MAXPKT + 1, 0);
			if (r <= 0 || r > MAXPKT) {
				gone(ep, fd);
				continue;
			}
			handle(clients[fd], buf, (size_t)r);
		}
	}
}
