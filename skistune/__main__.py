from skistune.entry import main

# (guarded: a process that re-imports the main module, as multiprocessing's spawn does, must not run the CLI)
if __name__ == "__main__":
    main()
