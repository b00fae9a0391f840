import java.util.ArrayList;

/**
 * Drives libmemquota_jni_demo.so, a Rust library with its own memquota budget, loaded
 * with System.loadLibrary: heap garbage grows the committed heap, then a native request
 * fits only after a GC shrinks it, then one that cannot fit is refused with
 * OutOfMemoryError carrying the report. Prints KEY=value lines for the test.
 *
 * Usage: java -Djava.library.path=DIR JniDemo GARBAGE_MIB HEADROOM_MIB ASK_MIB
 *    or: java JniDemo two LIBRARY_PATH OTHER_COPY_PATH   (loads two copies: two budgets)
 */
public class JniDemo {
    static native void allocate(long bytes);
    static native void release();
    static native String statsJson();
    static native long gcCount();
    static native long syncReclaims();
    static native long nativeBytes();
    static native void setLimit(long bytes);
    static native void pushHeap(long committed, long used);

    /** Below G1's humongous size at any heap size: 1 MiB arrays would be humongous. */
    static final int CHUNK = 64 << 10;
    static final long MIB = 1 << 20;

    public static void main(String[] args) {
        if (args[0].equals("two")) {
            System.load(args[1]);
            System.load(args[2]);
            System.out.println("LOADED_TWO");
            return;
        }
        long garbage = Long.parseLong(args[0]) * MIB;
        long headroom = Long.parseLong(args[1]) * MIB;
        long ask = Long.parseLong(args[2]) * MIB;
        System.loadLibrary("memquota_jni_demo");
        Runtime rt = Runtime.getRuntime();

        // Live while they are made, so the heap must commit room for all of them;
        // garbage once the list is dropped.
        ArrayList<byte[]> live = new ArrayList<>();
        for (long made = 0; made < garbage; made += CHUNK) {
            live.add(new byte[CHUNK]);
        }
        long before = rt.totalMemory();
        live = null;
        pushHeap(before, before - rt.freeMemory());

        // Room for `headroom` beside the heap as it is: `ask` fits only once a GC
        // gives `ask - headroom` back.
        long limit = nativeBytes() + before + headroom;
        setLimit(limit);
        System.out.println("HEAP_BEFORE=" + before);
        System.out.println("LIMIT=" + limit);
        allocate(ask);
        System.out.println("FIT=" + ask);
        System.out.println("HEAP_AFTER=" + rt.totalMemory());
        System.out.println("GCS=" + gcCount());
        System.out.println("SYNC_RECLAIMS=" + syncReclaims());

        try {
            allocate(limit);
            System.out.println("NOT_REFUSED=" + limit);
        } catch (OutOfMemoryError e) {
            System.out.println("REFUSED=" + limit);
            System.out.println("REPORT_BEGIN");
            System.out.println(e.getMessage());
            System.out.println("REPORT_END");
        }
        release();
        System.out.println("STATS=" + statsJson());
        System.out.println("DONE");
    }
}
