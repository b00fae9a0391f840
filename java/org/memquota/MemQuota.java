package org.memquota;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.List;

/**
 * The process's memquota budget, seen from Java.
 *
 * <p>Finds the libmemquota.so this process already runs under (the one given to
 * {@code LD_PRELOAD} and {@code -agentpath}) by its path in {@code /proc/self/maps},
 * or the path in the system property {@code memquota.library}, and binds its JNI
 * methods. Every method is static: there is one budget per process.
 *
 * <p>A later release attaches threads to task scopes through this class; its native
 * methods take plain {@code long} handles so that they can be driven from a task
 * listener.
 */
public final class MemQuota {
    /** The system property that names the library explicitly. */
    public static final String LIBRARY_PROPERTY = "memquota.library";

    private static final String FILE_NAME = "libmemquota.so";

    static {
        System.load(libraryPath());
    }

    private MemQuota() {}

    /** The budget's statistics as one JSON object (see docs/observability.md). */
    public static native String statsJson();

    /** The limit in bytes: native plus counted heap may not pass it. */
    public static native long limit();

    /**
     * Sets the limit in bytes.
     *
     * @throws IllegalArgumentException if {@code bytes <= 0}
     */
    public static void setLimit(long bytes) {
        if (bytes <= 0) {
            throw new IllegalArgumentException("memquota: the limit must be positive, got " + bytes);
        }
        setLimit0(bytes);
    }

    /** Moves the calling thread's not yet counted bytes to the process account. */
    public static native void flush();

    /** {@code System.gc()} calls memquota made to make room for native memory. */
    public static native long gcCount();

    private static native void setLimit0(long bytes);

    /** Where the library is: the property, else the mapped libmemquota.so. */
    static String libraryPath() {
        String path = System.getProperty(LIBRARY_PROPERTY);
        if (path != null && !path.isEmpty()) {
            return path;
        }
        try {
            List<String> maps = Files.readAllLines(Paths.get("/proc/self/maps"));
            for (String line : maps) {
                int slash = line.indexOf('/');
                if (slash >= 0 && line.endsWith("/" + FILE_NAME)) {
                    return line.substring(slash);
                }
            }
        } catch (IOException e) {
            throw new UnsatisfiedLinkError("memquota: cannot read /proc/self/maps: " + e);
        }
        throw new UnsatisfiedLinkError(
                "memquota: " + FILE_NAME + " is not loaded in this process. Run the JVM under it: "
                        + "LD_PRELOAD=/path/" + FILE_NAME + " java -agentpath:/path/" + FILE_NAME
                        + "=limit=4g ..., or set -D" + LIBRARY_PROPERTY + "=/path/" + FILE_NAME);
    }
}
