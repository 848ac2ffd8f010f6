// What the kernel check needs of a C library, on bare metal (boot.S): output to the first serial port, a
// bump allocator, the memory and math functions the kernels call, and OpenMP's thread queries (one thread).

#include <immintrin.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

static inline void outb(uint16_t port, uint8_t v) { __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port)); }
static inline uint8_t inb(uint16_t port) {
    uint8_t v;
    __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port));
    return v;
}

static void put(char c) {
    while (!(inb(0x3F8 + 5) & 0x20)) {
    }
    outb(0x3F8, (uint8_t)c);
}

static void put_text(const char *s) {
    while (*s) put(*s++);
}

static void put_unsigned(unsigned long long v) {
    char digits[24];
    int n = 0;
    do digits[n++] = (char)('0' + v % 10), v /= 10;
    while (v);
    while (n) put(digits[--n]);
}

static void put_signed(long long v) {
    if (v < 0) put('-'), v = -v;
    put_unsigned((unsigned long long)v);
}

static void put_double(double v) {  // d.dddddde+-x: enough to read an error
    if (v != v) return put_text("nan");
    if (v < 0) put('-'), v = -v;
    int e = 0;
    if (v != 0) {
        while (v >= 10) v /= 10, e++;
        while (v < 1) v *= 10, e--;
    }
    const long long scaled = (long long)(v * 1e6 + 0.5);
    put_unsigned((unsigned long long)(scaled / 1000000));
    put('.');
    char frac[7];
    long long f = scaled % 1000000;
    for (int i = 5; i >= 0; i--) frac[i] = (char)('0' + f % 10), f /= 10;
    for (int i = 0; i < 6; i++) put(frac[i]);
    put('e');
    put_signed(e);
}

int printf(const char *format, ...) {
    va_list args;
    va_start(args, format);
    for (const char *p = format; *p; p++) {
        if (*p != '%') {
            put(*p);
            continue;
        }
        p++;
        if (*p == 'l' && p[1] == 'l') p += 2;
        switch (*p) {
            case 'd': put_signed(p[-1] == 'l' ? va_arg(args, long long) : va_arg(args, int)); break;
            case 's': put_text(va_arg(args, const char *)); break;
            case 'g': put_double(va_arg(args, double)); break;
            case '%': put('%'); break;
            default: put('?');
        }
    }
    va_end(args);
    return 0;
}

static uint8_t heap[128 << 20] __attribute__((aligned(64)));
static size_t used;

void *aligned_alloc(size_t align, size_t size) {
    used = (used + align - 1) / align * align;
    if (used + size > sizeof(heap)) return NULL;
    void *p = heap + used;
    used += size;
    return p;
}

void *malloc(size_t size) { return aligned_alloc(64, size); }
void free(void *p) { (void)p; }

void *memcpy(void *dst, const void *src, size_t n) {
    uint8_t *d = dst;
    const uint8_t *s = src;
    while (n--) *d++ = *s++;
    return dst;
}

void *memset(void *dst, int c, size_t n) {
    uint8_t *d = dst;
    while (n--) *d++ = (uint8_t)c;
    return dst;
}

int memcmp(const void *a, const void *b, size_t n) {
    const uint8_t *x = a, *y = b;
    for (; n; n--, x++, y++)
        if (*x != *y) return *x < *y ? -1 : 1;
    return 0;
}

long lrintf(float x) { return _mm_cvtss_si32(_mm_set_ss(x)); }  // the current rounding: to nearest
float fabsf(float x) { return x < 0 ? -x : x; }
double sqrt(double x) { return _mm_cvtsd_f64(_mm_sqrt_sd(_mm_setzero_pd(), _mm_set_sd(x))); }
int omp_get_max_threads(void) { return 1; }
int omp_get_thread_num(void) { return 0; }

int main(void);

void kmain(void) {
    outb(0x3F8 + 3, 0x80);  // the serial port: 115200 baud (divisor 1), 8 data bits, no parity, 1 stop bit
    outb(0x3F8 + 0, 1);
    outb(0x3F8 + 1, 0);
    outb(0x3F8 + 3, 0x03);
    put_text("\n=== start\n");
    const int failed = main();
    printf("=== exit %d\n", failed);
}
