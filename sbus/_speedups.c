/* sbus._speedups: batch receive and batch send for SOCK_SEQPACKET sockets, and the
 * one per-packet rule of the server's hot path that profiles as its largest Python cost.
 *
 * Python's socket module has neither recvmmsg(2) nor sendmmsg(2). This optional
 * extension adds the two calls the server's transport needs (sbus/seqpacket.py), and
 * `run_extent`, the test that lets the broker queue a publisher's run of messages to
 * the same recipients without a Python call per message. Each has its rule in plain
 * Python beside it (the pure path). When the extension cannot be built, or
 * SBUS_PURE_PYTHON=1 is set, the transport uses socket.recv_into/send instead.
 *
 *   recv_batch(fd, count, size) -> list
 *       Up to `count` packets in one recvmmsg(MSG_DONTWAIT | MSG_TRUNC) call, each
 *       into its own `size`-byte slot of one process-wide buffer. Each item of the
 *       list is the packet as bytes, or, for a packet longer than `size`, its real
 *       length as an int (its data is discarded, as recv with MSG_TRUNC does). A
 *       zero-length packet (which reads exactly like end of file) is returned as b""
 *       and ends the list. An empty list means nothing was waiting (EAGAIN).
 *       Other errors raise OSError.
 *
 *   send_batch(fd, packets, start=0) -> int
 *       Send packets[start:] (a list of bytes, one packet each) with as few
 *       sendmmsg(MSG_NOSIGNAL | MSG_DONTWAIT) calls as it takes; return how many
 *       went. Stops at the first packet the socket does not take: EAGAIN is not an
 *       error (the count says how far it got); another error raises OSError only
 *       if nothing was sent by this call (the next call reports it otherwise).
 *
 *   run_extent(packets, start, cached, clients, room_bytes, room_packets) -> (end, nbytes)
 *       How far packets[start:] continue a publisher's run (the broker's
 *       `packetsReceived`): each one a bytes "MSG KEY\0..." with no '!' in KEY
 *       whose recipients, `cached(KEY)`, are `clients` itself, while the run stays
 *       within `room_bytes` bytes and `room_packets` packets. Returns the index of
 *       the first packet that does not, and the bytes of those before it. The
 *       rule in plain Python, which this must equal, is sbus.core.runs.run_extent.
 *
 * The reactor is single-threaded and these calls never block, so the GIL is
 * kept: the module's buffers are used under it.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_BATCH 1024 /* UIO_MAXIOV: the kernel's limit per sendmmsg/recvmmsg call */
/* A slot that took a packet longer than this gives the pages beyond it back after the copy,
 * so a burst of big packets leaves at most count * KEEP_BYTES resident, not count * size. */
#define KEEP_BYTES (64 * 1024)

static char *rbuf;           /* count * size bytes, mmap'd: pages appear only when written */
static size_t rbuf_len;
static struct mmsghdr rmsgs[MAX_BATCH];
static struct iovec riov[MAX_BATCH];
static struct mmsghdr smsgs[MAX_BATCH];
static struct iovec siov[MAX_BATCH];

static int
ensure_rbuf(size_t need)
{
	void *p;
	if (need <= rbuf_len)
		return 0;
	if (rbuf)
		munmap(rbuf, rbuf_len);
	rbuf = NULL;
	rbuf_len = 0;
	p = mmap(NULL, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED) {
		PyErr_SetFromErrno(PyExc_OSError);
		return -1;
	}
	rbuf = p;
	rbuf_len = need;
	return 0;
}

/* A descriptor number from Python: an int that fits a C int, else OverflowError (a long
 * truncated to int would name another descriptor: 2**40 became fd 0). */
static int
fd_arg(PyObject *obj, int *fd)
{
	long v = PyLong_AsLong(obj);

	if (v == -1 && PyErr_Occurred())
		return -1;
	if (v < INT_MIN || v > INT_MAX) {
		PyErr_SetString(PyExc_OverflowError, "file descriptor out of range");
		return -1;
	}
	*fd = (int)v;
	return 0;
}

static PyObject *
recv_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	int fd, n, i;
	Py_ssize_t count, size;
	size_t stride, page = (size_t)sysconf(_SC_PAGESIZE);
	PyObject *list, *item;

	if (nargs != 3) {
		PyErr_SetString(PyExc_TypeError, "recv_batch(fd, count, size)");
		return NULL;
	}
	if (fd_arg(args[0], &fd) < 0)
		return NULL;
	count = PyLong_AsSsize_t(args[1]);
	size = PyLong_AsSsize_t(args[2]);
	if (PyErr_Occurred())
		return NULL;
	if (fd < 0 || count < 1 || count > MAX_BATCH || size < 1 || size > (1 << 30)) {
		PyErr_SetString(PyExc_ValueError, "recv_batch: need fd >= 0, 1 <= count <= 1024, 1 <= size <= 1 GiB");
		return NULL;
	}
	stride = ((size_t)size + page - 1) / page * page; /* slots start on a page */
	if (ensure_rbuf((size_t)count * stride))
		return NULL;
	for (i = 0; i < count; i++) {
		riov[i].iov_base = rbuf + (size_t)i * stride;
		riov[i].iov_len = (size_t)size;
		memset(&rmsgs[i].msg_hdr, 0, sizeof(rmsgs[i].msg_hdr));
		rmsgs[i].msg_hdr.msg_iov = &riov[i];
		rmsgs[i].msg_hdr.msg_iovlen = 1;
		rmsgs[i].msg_len = 0;
	}
	n = recvmmsg(fd, rmsgs, (unsigned int)count, MSG_DONTWAIT | MSG_TRUNC, NULL);
	if (n < 0) {
		if (errno == EAGAIN || errno == EWOULDBLOCK)
			return PyList_New(0);
		return PyErr_SetFromErrno(PyExc_OSError);
	}
	/* At end of file every remaining slot reads as a zero-length packet: stop at the first. */
	for (i = 0; i < n; i++)
		if (rmsgs[i].msg_len == 0) {
			n = i + 1;
			break;
		}
	list = PyList_New(n);
	if (!list)
		return NULL;
	for (i = 0; i < n; i++) {
		size_t len = rmsgs[i].msg_len;
		if (len > (size_t)size || (rmsgs[i].msg_hdr.msg_flags & MSG_TRUNC))
			item = PyLong_FromSize_t(len);
		else
			item = PyBytes_FromStringAndSize(riov[i].iov_base, (Py_ssize_t)len);
		if (!item) {
			Py_DECREF(list);
			return NULL;
		}
		PyList_SET_ITEM(list, i, item);
	}
	for (i = 0; i < n; i++) {
		size_t used = rmsgs[i].msg_len < (size_t)size ? rmsgs[i].msg_len : (size_t)size;
		if (used > KEEP_BYTES) /* KEEP_BYTES is a multiple of the page size */
			madvise((char *)riov[i].iov_base + KEEP_BYTES, (used - KEEP_BYTES + page - 1) / page * page,
			        MADV_DONTNEED);
	}
	return list;
}

static PyObject *
send_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	int fd, r, i, k;
	Py_ssize_t start = 0, total, sent = 0;
	PyObject *packets, *p;

	if (nargs < 2 || nargs > 3) {
		PyErr_SetString(PyExc_TypeError, "send_batch(fd, packets, start=0)");
		return NULL;
	}
	if (fd_arg(args[0], &fd) < 0)
		return NULL;
	packets = args[1];
	if (!PyList_Check(packets)) {
		PyErr_SetString(PyExc_TypeError, "send_batch: packets must be a list of bytes");
		return NULL;
	}
	if (nargs == 3) {
		start = PyLong_AsSsize_t(args[2]);
		if (start == -1 && PyErr_Occurred())
			return NULL;
	}
	total = PyList_GET_SIZE(packets);
	if (fd < 0 || start < 0 || start > total) {
		PyErr_SetString(PyExc_ValueError, "send_batch: bad fd or start");
		return NULL;
	}
	while (start + sent < total) {
		k = (int)(total - start - sent > MAX_BATCH ? MAX_BATCH : total - start - sent);
		for (i = 0; i < k; i++) {
			p = PyList_GET_ITEM(packets, start + sent + i);
			if (!PyBytes_Check(p)) {
				PyErr_SetString(PyExc_TypeError, "send_batch: packets must be bytes");
				return NULL;
			}
			siov[i].iov_base = PyBytes_AS_STRING(p);
			siov[i].iov_len = (size_t)PyBytes_GET_SIZE(p);
			memset(&smsgs[i].msg_hdr, 0, sizeof(smsgs[i].msg_hdr));
			smsgs[i].msg_hdr.msg_iov = &siov[i];
			smsgs[i].msg_hdr.msg_iovlen = 1;
		}
		r = sendmmsg(fd, smsgs, (unsigned int)k, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (r < 0) {
			if (errno == EAGAIN || errno == EWOULDBLOCK || sent)
				break;
			return PyErr_SetFromErrno(PyExc_OSError);
		}
		sent += r;
		if (r < k)
			break;
	}
	return PyLong_FromSsize_t(sent);
}

static PyObject *
run_extent(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
	PyObject *packets, *cached, *clients, *p, *key, *got, *prevp = NULL, *res;
	Py_ssize_t start, j, room_bytes, room_packets, total = 0, len, klen, prevlen = -1;
	const char *s, *nul, *prev = NULL;

	if (nargs != 6 || !PyList_CheckExact(args[0])) {
		PyErr_SetString(PyExc_TypeError,
		                "run_extent(packets: list, start, cached, clients, room_bytes, room_packets)");
		return NULL;
	}
	packets = args[0];
	cached = args[2];
	clients = args[3];
	start = PyLong_AsSsize_t(args[1]);
	room_bytes = PyLong_AsSsize_t(args[4]);
	room_packets = PyLong_AsSsize_t(args[5]);
	if ((start == -1 || room_bytes == -1 || room_packets == -1) && PyErr_Occurred())
		return NULL;
	if (start < 0)
		start = 0;
	/* The list's size is read each time round: `cached` is the router's dict.get, but it is a
	 * callable, and one that ran Python could change the list. */
	for (j = start; j < PyList_GET_SIZE(packets) && j - start < room_packets; j++) {
		p = PyList_GET_ITEM(packets, j);
		if (!PyBytes_CheckExact(p))
			break;
		s = PyBytes_AS_STRING(p);
		len = PyBytes_GET_SIZE(p);
		if (len < 5 || memcmp(s, "MSG ", 4))
			break;
		nul = memchr(s + 4, 0, (size_t)(len - 4));
		if (!nul)
			break;
		klen = nul - (s + 4);
		if (memchr(s + 4, '!', (size_t)klen))
			break;
		if (total + len > room_bytes)
			break;
		/* The same key as the packet before: the same answer, without asking again (the
		 * packet it was read from is held, so the bytes compared stay valid). */
		if (klen != prevlen || memcmp(prev, s + 4, (size_t)klen)) {
			Py_INCREF(p);
			key = PyBytes_FromStringAndSize(s + 4, klen);
			got = key ? PyObject_CallOneArg(cached, key) : NULL;
			Py_XDECREF(key);
			if (!got) {
				Py_DECREF(p);
				Py_XDECREF(prevp);
				return NULL;
			}
			Py_DECREF(got); /* only its identity is compared; `clients` holds a reference */
			Py_XDECREF(prevp);
			prevp = p;
			if (got != clients)
				break;
			prev = PyBytes_AS_STRING(p) + 4;
			prevlen = klen;
		}
		total += len;
	}
	res = Py_BuildValue("nn", j, total);
	Py_XDECREF(prevp);
	return res;
}

static PyMethodDef methods[] = {
	{"recv_batch", (PyCFunction)(void (*)(void))recv_batch, METH_FASTCALL,
	 "recv_batch(fd, count, size) -> list of bytes (int: size of a truncated packet)"},
	{"send_batch", (PyCFunction)(void (*)(void))send_batch, METH_FASTCALL,
	 "send_batch(fd, packets, start=0) -> number of packets sent"},
	{"run_extent", (PyCFunction)(void (*)(void))run_extent, METH_FASTCALL,
	 "run_extent(packets, start, cached, clients, room_bytes, room_packets) -> (end, nbytes)"},
	{NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
	PyModuleDef_HEAD_INIT, "sbus._speedups",
	"Batch receive and send (recvmmsg/sendmmsg) for the SEQPACKET transport, and run_extent.", -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
	PyObject *m = PyModule_Create(&module);
	if (m && PyModule_AddIntConstant(m, "MAX_BATCH", MAX_BATCH)) {
		Py_DECREF(m);
		return NULL;
	}
	return m;
}
