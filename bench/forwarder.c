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

struct client {
	int fd, npats, cap;
	struct pat *pats;
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

int
main(int argc, char **argv)
{
	struct sockaddr_un a;
	struct epoll_event ev, evs[64];
	char *buf = malloc(MAXPKT + 1);
	int srv, ep, n, i;
	if (argc != 2) {
		fprintf(stderr, "usage: forwarder SOCK\n");
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
				ev.events = EPOLLIN;
				ev.data.fd = c;
				epoll_ctl(ep, EPOLL_CTL_ADD, c, &ev);
				continue;
			}
			r = recv(fd, buf, MAXPKT + 1, 0);
			if (r <= 0 || r > MAXPKT) {
				gone(ep, fd);
				continue;
			}
			buf[r] = 0;
			if (r >= 4 && !memcmp(buf, "MSG ", 4)) {
				size_t kl = strlen(buf + 4);
				for (int j = 0; j < nsubs; j++) {
					struct client *c = clients[subs[j]];
					for (int k = 0; k < c->npats; k++)
						if (matches(&c->pats[k], buf + 4, kl)) {
							send(c->fd, buf, (size_t)r, MSG_NOSIGNAL);
							break;
						}
				}
			} else if (r >= 4 && !memcmp(buf, "SUB ", 4)) {
				struct client *c = clients[fd];
				if (c->npats == c->cap) {
					c->cap = c->cap ? 2 * c->cap : 4;
					c->pats = realloc(c->pats, (size_t)c->cap * sizeof *c->pats);
				}
				c->pats[c->npats].s = strdup(buf + 4);
				c->pats[c->npats].n = strlen(buf + 4);
				if (!c->npats++)
					subs[nsubs++] = fd;
			} else if (r >= 6 && !memcmp(buf, "UNSUB ", 6)) {
				struct client *c = clients[fd];
				for (int k = 0; k < c->npats; k++)
					if (!strcmp(c->pats[k].s, buf + 6)) {
						free(c->pats[k].s);
						c->pats[k] = c->pats[--c->npats];
						if (!c->npats)
							drop_sub(fd);
						break;
					}
			}
		}
	}
}
