// A bare-metal start for the kernel check (bench/isa_check.py): loaded by a multiboot loader (isolinux's
// mboot.c32) in 32-bit protected mode, it maps the first GiB, enters long mode, turns on SSE, AVX and the
// AVX-512 state (XCR0), and calls kmain. No operating system: an emulator's CPU model needs to get only the
// instructions right, not the save areas an OS checks.

#define MB_MAGIC 0x1BADB002
#define MB_FLAGS 0x00010003  /* page-aligned modules, memory info, load addresses in this header */

    .section .multiboot, "a"
    .align 4
header:
    .long MB_MAGIC, MB_FLAGS, -(MB_MAGIC + MB_FLAGS)
    .long header, image_start, load_end, bss_end, start32

    .section .text
    .code32
    .globl start32
start32:
    cli
    mov $stack_top, %esp
    mov $pml4, %edi               // the loader need not zero .bss: the tables at least are
    xor %eax, %eax
    mov $(3 * 1024), %ecx
    rep stosl
    // page tables: PML4[0] -> PDPT[0] -> PD of 512 2-MiB pages (identity, the first GiB)
    mov $pdpt, %eax
    or $3, %eax
    mov %eax, pml4
    mov $pd, %eax
    or $3, %eax
    mov %eax, pdpt
    xor %ecx, %ecx
1:  mov %ecx, %eax
    shl $21, %eax
    or $0x83, %eax
    mov %eax, pd(, %ecx, 8)
    inc %ecx
    cmp $512, %ecx
    jne 1b
    mov $pml4, %eax
    mov %eax, %cr3
    mov %cr4, %eax
    or $(1 << 5), %eax            // PAE
    mov %eax, %cr4
    mov $0xC0000080, %ecx         // EFER.LME
    rdmsr
    or $(1 << 8), %eax
    wrmsr
    mov %cr0, %eax
    or $0x80000001, %eax          // PG, PE
    mov %eax, %cr0
    lgdt gdt_pointer
    ljmp $0x08, $start64

    .code64
start64:
    xor %eax, %eax
    mov %eax, %ds
    mov %eax, %es
    mov %eax, %ss
    mov $stack_top, %rsp
    mov %cr0, %rax
    and $~(1 << 2), %rax          // EM off
    or $(1 << 1), %rax            // MP
    mov %rax, %cr0
    mov %cr4, %rax
    or $((1 << 9) | (1 << 10) | (1 << 18)), %rax  // OSFXSR, OSXMMEXCPT, OSXSAVE
    mov %rax, %cr4
    xor %ecx, %ecx
    xgetbv
    or $0x07, %eax                // x87, SSE, AVX
    mov %eax, %esi
    mov $0xD, %eax                // the AVX-512 states too, where CPUID offers them
    xor %ecx, %ecx
    cpuid
    and $0xE0, %eax
    or %esi, %eax
    xor %edx, %edx
    xor %ecx, %ecx
    xsetbv
    call kmain
2:  cli
    hlt
    jmp 2b

    .section .rodata
    .align 8
gdt:
    .quad 0
    .quad 0x00AF9A000000FFFF      // 64-bit code
    .quad 0x00CF92000000FFFF      // data
gdt_pointer:
    .word gdt_pointer - gdt - 1
    .long gdt

    .section .bss
    .align 4096
pml4: .space 4096
pdpt: .space 4096
pd:   .space 4096
    .align 16
    .space 1 << 20
stack_top:
